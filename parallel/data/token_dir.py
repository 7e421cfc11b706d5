"""A tokenized dataset directory (what `trainyard prepare` writes) and reading one back.

On disk (all names fixed here, used by `parallel.data.prepare` to write and by `parallel.data.datasets` to read):

    DIR/manifest.json          written last; describes everything below (see `Manifest`)
    DIR/tokenizer.json         the Hugging Face `tokenizers` tokenizer the tokens came from
    DIR/tokenizer_config.json  copied when the source had one (eos token, chat template)
    DIR/tokens-00000.bin ...   token ids, flat little-endian uint16 (vocab <= 65536) or uint32; documents
                               one after another, each followed by the EOS id
    DIR/mask-00000.bin ...     chat data only: uint8, one per token; 1 where the token is an assistant or
                               completion token, i.e. counted in the loss when it is a target
    DIR/documents.bin          little-endian uint64, one per document: where it ends in the token stream (its
                               EOS included), for whole-example training (`parallel.data.examples`)

The shards, in manifest order, are one token stream (a window may run across a shard boundary), so a
directory reads exactly like one flat file of its concatenated shards. A directory is written under a
temporary name and renamed once complete, like a checkpoint, so a directory holding a manifest is whole.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
DOCUMENT_ENDS = "documents.bin"
FORMAT = "trainyard-tokens"
VERSION = 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def shard_name(kind: str, index: int) -> str:
    """`tokens-00003.bin` or `mask-00003.bin`."""
    return f"{kind}-{index:05d}.bin"


def dtype_for(vocab_size: int) -> str:
    """The narrowest dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


@dataclass(frozen=True)
class Manifest:
    """What manifest.json holds (its keys are these fields)."""

    vocab_size: int
    """The tokenizer's vocabulary, added tokens included: every id is below it."""
    eos_id: int
    dtype: str
    """uint16 or uint32: the element type of the token shards."""
    documents: int
    tokens: int
    """Tokens in all shards, EOS separators included."""
    counted_tokens: int | None
    """Chat data: tokens whose mask is 1; None without a mask."""
    shards: list[dict]
    """In stream order: {file, tokens, bytes, sha256} and, with a mask, {mask_file, mask_sha256}."""
    tokenizer: dict
    """{file, sha256, config (tokenizer_config.json or null), eos_token}."""
    fingerprint: str
    """sha256 of the inputs' contents, the tokenizer and the options: equal fingerprints, equal output."""
    inputs: list[dict]
    """{path, bytes, sha256} of each input file, in order."""
    options: dict
    """The options that shaped the tokens (field, column, chat, eos, shard_tokens)."""
    format: str = FORMAT
    version: int = VERSION
    document_ends: dict | None = None
    """{file, sha256} of `documents.bin`; null in a directory prepared before it existed (whole-example training
    needs it: prepare again)."""

    @property
    def chat(self) -> bool:
        return self.counted_tokens is not None

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2) + "\n"

    @staticmethod
    def read(directory: Path) -> Manifest:
        """Raises ValueError (saying what is wrong) for a manifest this version cannot read."""
        try:
            raw = json.loads((directory / MANIFEST).read_text())
            if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
                raise ValueError(f"not a {FORMAT} v{VERSION} manifest")
            manifest = Manifest(**raw)
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"unreadable {MANIFEST}: {e}") from None
        if manifest.dtype not in DTYPES:
            raise ValueError(f"{MANIFEST} names dtype {manifest.dtype!r}, not one of {sorted(DTYPES)}")
        if wrong := manifest._malformed():
            raise ValueError(f"{MANIFEST}: {wrong}")
        return manifest

    def _malformed(self) -> str | None:
        """What of the fields a reader relies on has the wrong shape (a manifest edited by hand, another tool's)."""
        def count(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 0

        for name in ("vocab_size", "eos_id", "documents", "tokens"):
            if not count(getattr(self, name)):
                return f"{name} is {getattr(self, name)!r}, not a count"
        if self.counted_tokens is not None and not count(self.counted_tokens):
            return f"counted_tokens is {self.counted_tokens!r}, not a count or null"
        if not isinstance(self.tokenizer, dict) or not isinstance(self.tokenizer.get("sha256"), str):
            return "tokenizer is not {file, sha256, ...}"
        if not isinstance(self.shards, list):
            return "shards is not a list"
        keys = ("file", "mask_file") if self.chat else ("file",)
        for i, shard in enumerate(self.shards):
            if not (isinstance(shard, dict) and count(shard.get("tokens"))
                    and all(isinstance(shard.get(k), str) for k in keys)):
                return f"shards[{i}] is not {{{', '.join(keys)}, tokens, ...}}"
            if not all(in_directory(shard[k]) for k in keys):
                return f"shards[{i}] names a file outside the directory (every file is one of its own)"
        ends = self.document_ends
        if ends is not None and not (isinstance(ends, dict) and in_directory(str(ends.get("file", "")))):
            return "document_ends names a file outside the directory (every file is one of its own)"
        return None


def in_directory(name: str) -> bool:
    """Whether a file name a manifest or index gives stays in its directory: relative, no `..` (a link inside
    the directory is the reader's access check's, `service.tenancy.access`)."""
    return bool(name) and not Path(name).is_absolute() and ".." not in Path(name).parts


def check_directory(directory: Path) -> Manifest | str:
    """The manifest of a prepared directory, or what is missing or wrong, said plainly. Checks that the
    files exist with their sizes (hashes are `verify_hashes`'s job: reading every shard is not a submit-time
    cost)."""
    if not (directory / MANIFEST).is_file():
        return f"{directory} is a directory without {MANIFEST}: not a `trainyard prepare` output"
    try:
        manifest = Manifest.read(directory)
    except ValueError as e:
        return f"{directory}: {e}"
    if not (directory / TOKENIZER).is_file():
        return f"{directory} has no {TOKENIZER} (the tokenizer its tokens came from)"
    itemsize = np.dtype(DTYPES[manifest.dtype]).itemsize
    for shard in manifest.shards:
        path = directory / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["tokens"] * itemsize:
            return f"{path} is missing or not {shard['tokens']} {manifest.dtype} tokens as {MANIFEST} says"
        mask = directory / shard["mask_file"] if manifest.chat else None
        if mask is not None and (not mask.is_file() or mask.stat().st_size != shard["tokens"]):
            return f"{mask} (the loss mask) is missing or not {shard['tokens']} bytes as {MANIFEST} says"
    if manifest.document_ends is not None:
        ends = directory / manifest.document_ends["file"]
        if not ends.is_file() or ends.stat().st_size != 8 * manifest.documents:
            return f"{ends} (where each document ends) is missing or not {manifest.documents} uint64 as {MANIFEST} says"
    return manifest


def document_ends(directory: Path, manifest: Manifest) -> np.ndarray:
    """Where each document of a prepared directory ends in its token stream (EOS included), ascending."""
    assert manifest.document_ends is not None
    path = directory / manifest.document_ends["file"]
    return np.fromfile(path, dtype="<u8").astype(np.int64) if path.stat().st_size else np.zeros(0, np.int64)


class Segments:
    """Several arrays read as one: `len`, and slices `[a:b]` (step 1) that may cross from one to the next.

    A slice within one segment is a view of its memory map; one across a boundary is a copy of the parts.
    """

    def __init__(self, parts: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.parts = parts
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + len(p))
        self.start = start
        self.stop = self.offsets[-1] if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("Segments take slices with step 1 only")
        a, b, _ = key.indices(len(self))
        b = max(a, b)
        return self._read(self.start + a, self.start + b)

    def sub(self, a: int, b: int) -> Segments:
        """Positions [a, b) of this view, as a view (the train / validation split)."""
        return Segments(self.parts, self.start + a, self.start + b)

    def _read(self, a: int, b: int) -> np.ndarray:
        i = bisect.bisect_right(self.offsets, a) - 1
        pieces = []
        while a < b:
            end = min(b, self.offsets[i + 1])
            pieces.append(self.parts[i][a - self.offsets[i]: end - self.offsets[i]])
            a, i = end, i + 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, self.parts[0].dtype if self.parts else np.uint8)


def open_streams(directory: Path, manifest: Manifest) -> tuple[Segments, Segments | None]:
    """The directory's tokens and (chat data) loss mask, each as one stream over its memory-mapped shards."""
    def mapped(name: str, dtype: type) -> np.ndarray:
        path = directory / name
        return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)

    tokens = Segments([mapped(s["file"], DTYPES[manifest.dtype]) for s in manifest.shards])
    mask = Segments([mapped(s["mask_file"], np.uint8) for s in manifest.shards]) if manifest.chat else None
    return tokens, mask
