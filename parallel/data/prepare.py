"""`trainyard prepare`: text, JSONL and Parquet to a tokenized dataset directory (format: `parallel.data.token_dir`).

Inputs are read in order by `parallel.data.readers` (a directory stands for its files, sorted): a text file is
one document, a JSONL line one document (its `field`) or, with `chat`, one fine-tuning record
(`parallel.data.chat`), a Parquet row one document (its `column`). This module tokenizes and writes: batches of
documents are tokenized by `workers` processes
(each loads the tokenizer once) and come back in input order, so the output does not depend on the number
of workers: the main process appends each document and the EOS id to the current shard and starts a new
shard every `shard_tokens` tokens.

The output is written under a temporary name beside `out` (`.NAME.tmp-HOST-PID`) and renamed into place once
complete (manifest last); what a run killed outright (SIGKILL, the OOM killer) left there is removed by the
next run on that host. Its fingerprint covers the inputs' contents, the tokenizer files and the options: when `out`
already holds a manifest with the same fingerprint, nothing is read or written again.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import numpy as np
from trainyard.parallel.data.chat import ChatError, encode_record, template_from_config
from trainyard.parallel.data.readers import (
    PrepareError,
    PrepareOptions,
    batches,
    describe_input,
    documents,
    input_files,
)
from trainyard.parallel.data.token_dir import (
    DOCUMENT_ENDS,
    DTYPES,
    MANIFEST,
    TOKENIZER,
    TOKENIZER_CONFIG,
    VERSION,
    Manifest,
    check_directory,
    dtype_for,
    file_sha256,
    is_prepared,
    shard_name,
)


@dataclass(frozen=True)
class PrepareResult:
    manifest: Manifest
    skipped: bool
    """True when `out` was already prepared from the same inputs, tokenizer and options."""
    seconds: float


@dataclass(frozen=True)
class TokenizerSource:
    file: Path
    config: dict | None
    config_file: Path | None

    @staticmethod
    def find(path: Path) -> TokenizerSource:
        """A tokenizer.json, or a model directory holding one (and maybe tokenizer_config.json)."""
        file = path / TOKENIZER if path.is_dir() else path
        if not file.is_file():
            raise PrepareError(f"--tokenizer: no tokenizer at {file} (a tokenizer.json, or a directory holding one)")
        config_file = file.parent / TOKENIZER_CONFIG
        if not config_file.is_file():
            return TokenizerSource(file, None, None)
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise PrepareError(f"{config_file} is not JSON: {e}") from None
        return TokenizerSource(file, config, config_file)

    def eos_token(self, override: str | None) -> str | None:
        if override is not None:
            return override
        token = (self.config or {}).get("eos_token")
        return token["content"] if isinstance(token, dict) else token


def fingerprint(inputs: list[dict], source: TokenizerSource, options: PrepareOptions) -> str:
    described = {"version": VERSION, "inputs": [i["sha256"] for i in inputs], "tokenizer": file_sha256(source.file),
                 "config": file_sha256(source.config_file) if source.config_file else None,
                 "options": asdict(options)}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_file: str, config: dict | None, chat: bool, eos_id: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER.update(tokenizer=Tokenizer.from_file(tokenizer_file), template=template_from_config(config),
                   chat=chat, eos_id=eos_id, dtype=DTYPES[dtype])


Encoded = tuple[np.ndarray, np.ndarray | None]


def _encode_batch(batch: list[tuple[str, Any]]) -> tuple[int, list[Encoded]]:
    """(documents read, each document's ids followed by EOS and, with chat, its mask); empty documents are
    left out."""
    w, out = _WORKER, list[Encoded]()
    if not w["chat"]:
        for enc in w["tokenizer"].encode_batch([text for _, text in batch], add_special_tokens=False):
            if enc.ids:
                out.append((np.array([*enc.ids, w["eos_id"]], dtype=w["dtype"]), None))
        return len(batch), out
    for where, record in batch:
        try:
            ids, mask = encode_record(w["tokenizer"], w["template"], record)
        except ChatError as e:
            raise PrepareError(f"{where}: {e}") from None
        if ids:
            out.append((np.array([*ids, w["eos_id"]], dtype=w["dtype"]),
                        np.array([*mask, mask[-1]], dtype=np.uint8)))
    return len(batch), out


class _ShardWriter:
    """Appends documents to tokens-NNNNN.bin (and mask-NNNNN.bin), a new pair every `shard_tokens` tokens."""

    def __init__(self, directory: Path, chat: bool, shard_tokens: int):
        self.directory, self.chat, self.shard_tokens = directory, chat, shard_tokens
        self.shards: list[dict] = []
        self.files: list[Any] = []
        self.hashes: list[Any] = []
        self.count = 0

    def write(self, ids: np.ndarray, mask: np.ndarray | None) -> None:
        while len(ids):
            if not self.files or self.count == self.shard_tokens:
                self._next_shard()
            take = min(len(ids), self.shard_tokens - self.count)
            parts = [ids[:take]] + ([mask[:take]] if mask is not None else [])
            for f, h, part in zip(self.files, self.hashes, parts, strict=True):
                data = part.tobytes()
                f.write(data)
                h.update(data)
            self.count += take
            ids, mask = ids[take:], (mask[take:] if mask is not None else None)

    def _next_shard(self) -> None:
        self._finish_shard()
        index = len(self.shards)
        names = [shard_name("tokens", index)] + ([shard_name("mask", index)] if self.chat else [])
        self.files = [open(self.directory / n, "wb") for n in names]  # noqa: SIM115 (closed in _finish_shard)
        self.hashes = [hashlib.sha256() for _ in names]
        self.shards.append({"file": names[0], **({"mask_file": names[1]} if self.chat else {})})
        self.count = 0

    def _finish_shard(self) -> None:
        if not self.files:
            return
        shard = self.shards[-1]
        shard.update(tokens=self.count, bytes=self.files[0].tell(), sha256=self.hashes[0].hexdigest())
        if self.chat:
            shard["mask_sha256"] = self.hashes[1].hexdigest()
        for f in self.files:
            f.close()
        self.files = []

    def close(self) -> list[dict]:
        self._finish_shard()
        return self.shards


def prepare(inputs: list[Path], out: Path, tokenizer: Path, options: PrepareOptions = PrepareOptions(),
            workers: int = 1, progress: bool = True) -> PrepareResult:
    """Tokenize `inputs` into the dataset directory `out` (a no-op when it is already that)."""
    from tokenizers import Tokenizer

    start = time.perf_counter()
    source = TokenizerSource.find(tokenizer)
    files = input_files(inputs, out)
    described = [describe_input(p) for p in files]
    inputs_meta, expected_docs = [d for d, _ in described], sum(n for _, n in described)
    print_ = (lambda m: print(m, file=sys.stderr)) if progress else (lambda m: None)
    tok = Tokenizer.from_file(str(source.file))
    eos_token = source.eos_token(options.eos)
    if eos_token is None:
        raise PrepareError(f"the tokenizer names no EOS token ({TOKENIZER_CONFIG} has no eos_token): give --eos")
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise PrepareError(f"EOS token {eos_token!r} is not in the tokenizer's vocabulary")
    if options.chat and source.config is not None and template_from_config(source.config) is None:
        print_(f"note: {source.config_file} has no chat_template: only prompt/completion records will work")
    fp = fingerprint(inputs_meta, source, options)
    if is_prepared(out):
        old = check_directory(out)  # a shard deleted or cut short since: prepare again
        if isinstance(old, Manifest) and old.fingerprint == fp and old.document_ends is not None:
            return PrepareResult(old, skipped=True, seconds=time.perf_counter() - start)
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PrepareError(f"-o: {out} exists and is not a prepared dataset directory; refusing to overwrite it")
    vocab = vocab_size(tok)
    dtype = dtype_for(vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    tmp = out.parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writer = _ShardWriter(tmp, options.chat, options.shard_tokens)
        docs = tokens = counted = 0
        ends, ends_hash = open(tmp / DOCUMENT_ENDS, "wb"), hashlib.sha256()  # noqa: SIM115 (closed below)
        from tqdm import tqdm

        init = (str(source.file), source.config, options.chat, eos_id, dtype)
        with tqdm(total=expected_docs, unit="doc", file=sys.stderr, disable=not progress, dynamic_ncols=True,
                  desc=f"prepare {out.name}") as bar, _pool(workers, init) as imap:
            for read, encoded in imap(batches(documents(files, options))):
                for ids, mask in encoded:
                    writer.write(ids, mask)
                    docs, tokens = docs + 1, tokens + len(ids)
                    counted += int(mask.sum()) if mask is not None else 0
                    end = np.array([tokens], dtype="<u8").tobytes()
                    ends.write(end)
                    ends_hash.update(end)
                bar.update(read)
                bar.set_postfix(tokens=tokens, refresh=False)
            bar.total = bar.n
        shards = writer.close()
        ends.close()
        named = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        if tokens == 0:
            raise PrepareError(f"{named}: no document to tokenize (every one is empty)")
        if options.chat and counted == 0:  # a warning: such a set still serves (an all-masked batch, prompts only)
            print(f"warning: {named}: no record has an assistant message or a completion: nothing counts in the "
                  "loss of a job that trains on it", file=sys.stderr)
        shutil.copyfile(source.file, tmp / TOKENIZER)
        if source.config_file is not None:
            shutil.copyfile(source.config_file, tmp / TOKENIZER_CONFIG)
        manifest = Manifest(
            vocab_size=vocab, eos_id=eos_id, dtype=dtype, documents=docs, tokens=tokens,
            counted_tokens=counted if options.chat else None, shards=shards,
            tokenizer={"file": TOKENIZER, "sha256": file_sha256(source.file),
                       "config": TOKENIZER_CONFIG if source.config_file else None, "eos_token": eos_token},
            fingerprint=fp, inputs=inputs_meta, options=asdict(options),
            document_ends={"file": DOCUMENT_ENDS, "sha256": ends_hash.hexdigest()})
        (tmp / MANIFEST).write_text(manifest.to_json())
        _swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PrepareResult(manifest, skipped=False, seconds=time.perf_counter() - start)


def vocab_size(tok: Any) -> int:
    """One more than the largest id the tokenizer can give: its size, or more when its ids have gaps (a
    vocabulary {..., "<eos>": 70000} of 11 tokens gives id 70000, which neither uint16 nor a vocab_size of 11
    holds)."""
    return max(tok.get_vocab_size(with_added_tokens=True), max(tok.get_vocab(with_added_tokens=True).values(),
                                                               default=-1) + 1)


class _pool:
    """`imap(batches)` yielding (documents read, encoded) per batch in input order: `workers` processes, or
    this one for workers=1."""

    def __init__(self, workers: int, init: tuple):
        self.workers, self.init = workers, init
        self.pool: Pool | None = None

    def __enter__(self) -> Callable[[Iterable[list[tuple[str, Any]]]], Iterator[tuple[int, list[Encoded]]]]:
        if self.workers <= 1:
            _init_worker(*self.init)
            return lambda batches: (_encode_batch(b) for b in batches)
        pool = self.pool = multiprocessing.get_context("spawn").Pool(self.workers, _init_worker, self.init)
        return lambda batches: pool.imap(_encode_batch, batches, chunksize=1)

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory to `out`; an older preparation there is moved aside first, then removed."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{socket.gethostname()}-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(out: Path) -> None:
    """Remove the temporary directories (`.NAME.tmp-HOST-PID`, `.NAME.old-HOST-PID`) that runs on this host left
    beside `out` when killed outright; those of a process still running (another prepare) are kept."""
    if not out.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(tmp|old)-{re.escape(socket.gethostname())}-(\d+)")
    for path in out.parent.iterdir():
        found = pattern.fullmatch(path.name)
        if found and not _running(int(found[2])):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))
