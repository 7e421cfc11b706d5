"""`trainyard prepare`'s readers: the files its inputs stand for, and the documents in them, in input order.

A text file is one document, a JSONL line one document (its `field`) or, with `chat`, one fine-tuning record
(`parallel.data.chat`), a Parquet row one document (its `column`, read with pyarrow, batch by batch). Each
document comes with where it was read (`path:line`, `path row N`), which every error names. Also owns the
options that shape the tokens and the error a bad input raises (`parallel.data.prepare` tokenizes and writes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BATCH_DOCS = 64
"""Documents per task handed to a worker process."""


class PrepareError(ValueError):
    """Inputs, tokenizer or options that cannot be prepared; the message says which and why."""


@dataclass(frozen=True)
class PrepareOptions:
    """The options that shape the tokens (all in the fingerprint; the number of workers is not)."""

    field: str = "text"
    """JSONL: the field holding a document's text."""
    column: str = "text"
    """Parquet: the column holding a document's text."""
    chat: bool = False
    """JSONL of fine-tuning records; a loss mask is stored beside the tokens."""
    eos: str | None = None
    """The EOS token (its text); None: the tokenizer_config.json's `eos_token`."""
    shard_tokens: int = 100_000_000
    """Tokens per shard file (the last one holds the rest)."""


def input_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return "jsonl" if suffix in (".jsonl", ".json", ".ndjson") else "parquet" if suffix == ".parquet" else "text"


def input_files(inputs: list[Path], out: Path | None = None) -> list[Path]:
    """The files `inputs` stand for; in a directory, hidden files and folders (an interrupted run's temporary
    output) and the output directory `out` itself are left out."""
    files, skip = [], out.resolve() if out is not None else None
    for path in inputs:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts)
                            and not (skip is not None and p.resolve().is_relative_to(skip)))
        elif path.is_file():
            files.append(path)
        else:
            raise PrepareError(f"input not found: {path}")
    if not files:
        raise PrepareError("no input files")
    return files


def describe_input(path: Path) -> tuple[dict, int]:
    """({path, bytes, sha256}, documents it holds at most) in one pass over the file."""
    h, lines, size = hashlib.sha256(), 0, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
            lines += block.count(b"\n")
            size += len(block)
    kind = input_kind(path)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            docs = pq.ParquetFile(path).metadata.num_rows
        except pa.ArrowException as e:
            raise PrepareError(f"{path}: not a readable Parquet file: {e}") from None
    else:
        docs = lines + 1 if kind == "jsonl" else 1
    return {"path": str(path.resolve()), "bytes": size, "sha256": h.hexdigest()}, docs


def documents(files: list[Path], options: PrepareOptions) -> Iterator[tuple[str, Any]]:
    """(where, document) in input order: the text, or with chat the record."""
    for path in files:
        kind = input_kind(path)
        if options.chat and kind != "jsonl":
            raise PrepareError(f"{path}: --chat reads JSONL records, not {kind}")
        if kind == "text":
            yield str(path), _decode(path.read_bytes(), str(path))
        elif kind == "jsonl":
            yield from _jsonl(path, options)
        else:
            yield from _parquet(path, options.column)


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{where}: not UTF-8 (byte {e.start}: {e.reason})") from None


def _jsonl(path: Path, options: PrepareOptions) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            line = _decode(raw, where)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepareError(f"{where}: not JSON: {e}") from None
            if options.chat:
                yield where, record
                continue
            if not isinstance(record, dict) or not isinstance(record.get(options.field), str):
                raise PrepareError(f"{where}: no string field {options.field!r} (--field names it)")
            yield where, record[options.field]


def _parquet(path: Path, column: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    if column not in file.schema_arrow.names:
        raise PrepareError(f"{path}: no column {column!r} (--column names it; it has {file.schema_arrow.names})")
    row = 0
    for batch in file.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                if not isinstance(value, str):
                    raise PrepareError(f"{path} row {row}: column {column!r} holds {type(value).__name__}, not text")
                yield f"{path} row {row}", value
            row += 1


def batches(docs: Iterator[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    batch = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch
