"""A safetensors file written one group of tensors at a time: the whole model never in memory at once.

`safetensors.torch.save_file` takes every tensor at once (and copies each into bytes before writing), so an
export that gathered the model first held it two to three times over: on the rank that exports a job's model
(rank 0, as the job ends, beside its own shards) that was the largest resident peak of the whole job. The format
is simple enough to write in pieces: an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, padded with spaces to 8 bytes, then the tensors' bytes back to back in the header's
order. The header needs only shapes and dtypes (known from the model built on the meta device), so it is written
first and each tensor's bytes follow as `fill` produces them; `safetensors.torch.load_file` reads the result as
one written whole.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
"""safetensors' names of the dtypes a model holds."""

Entry = tuple[str, tuple[int, ...], torch.dtype]
"""A tensor of the file: its name, shape and dtype."""


def header_bytes(entries: Sequence[Entry], metadata: dict[str, str]) -> bytes:
    """The file's first part: the header's length and the header, each tensor at the offset after the one before."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the tensors' bytes start 8-aligned, as safetensors writes them
    return struct.pack("<Q", len(raw)) + raw


def write_streamed(path: Path, entries: Sequence[Entry], fill: Callable[[Sequence[Entry]], list[torch.Tensor]],
                   metadata: dict[str, str], group_bytes: int = 64 << 20) -> None:
    """Write `entries` to `path`, asking `fill` for the tensors of a group of consecutive entries at a time (about
    `group_bytes` of them, or one larger tensor) and dropping them once written."""
    if sys.byteorder != "little":  # safetensors is little-endian; tensors are written as they lie in memory
        raise RuntimeError("safetensors streaming needs a little-endian machine")
    with path.open("wb") as f:
        f.write(header_bytes(entries, metadata))
        group: list[Entry] = []
        for k, entry in enumerate(entries):
            group.append(entry)
            size = sum(math.prod(s) * d.itemsize for _, s, d in group)
            if size >= group_bytes or k == len(entries) - 1:
                for (name, shape, dtype), tensor in zip(group, fill(group), strict=True):
                    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                        raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the header says {shape} "
                                         f"{dtype}")
                    f.write(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
                group = []
