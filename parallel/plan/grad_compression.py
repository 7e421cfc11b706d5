"""What the plan knows of each gradient compressor (`parallel.grad_compression.kind`), pure (no torch): what a
gradient matrix costs compressed, the bytes it sends per step and the bytes it keeps on the rank, and whether the
compressor needs every rank's whole gradients. `reduction_bytes` (what a step sends) and the memory plan
(`compression_state_bytes`) read it, and the rules refuse ZeRO-2/3 with a compressor that needs whole gradients.
How a compressor runs on a rank is `parallel.runtime.compression.COMPRESSORS`, under the same names
(tests/unit/test_grads.py holds the two equal).

- `powersgd` (Vogels et al. 2019, `parallel.runtime.compression.powersgd`): a matrix large enough to gain
  (`approximation_rank`, torch's rule) sends two fp32 factors, P (rows x r) and Q (cols x r), and keeps its error
  (rows x cols) and the factors with their packed copies on the wire.
- `topk` (Aji & Heafield 2017, `parallel.runtime.compression.topk`): every matrix sends its k = `topk_count`
  largest elements as (int32 index, fp32 value) pairs, 8 bytes each, and keeps its residual (rows x cols fp32,
  with error feedback), its own pairs and the group's gathered ones (`ranks` x its own).
- `qsgd` (Alistarh et al. 2017, `parallel.runtime.compression.qsgd`): every matrix sends one code of
  `qsgd_code_bits` bits per element, packed into bytes, and an fp32 norm per `bucket_size` elements; it keeps its
  own codes and the group's gathered ones.

A gathering compressor (topk, qsgd) all-gathers what each rank sends, so what it keeps grows with the group's
size (`ranks`); the payload a rank hands to the collective (`sent`) does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from trainyard.parallel.config import GradCompressionConfig
from trainyard.parallel.models.counting import FP32
from trainyard.parallel.names import COMPRESSION_NAMES, CompressionName, registry


@dataclass(frozen=True)
class Compressed:
    """What one gradient matrix costs compressed."""

    sent: int
    """Bytes it sends per step (after the compressor's warm-up)."""
    kept: int
    """Bytes the compressor keeps for it on the rank beside the gradient buckets."""


@dataclass(frozen=True)
class CompressionKind:
    """What the plan knows of one compressor."""

    matrix: Callable[[int, int, GradCompressionConfig, int], Compressed | None]
    """What a rows x cols gradient matrix (a parameter's local gradient, more dimensions flattened after the first)
    costs compressed, reduced over a group of `ranks` ranks (the last argument); None: it is sent whole, packed in
    one buffer with the 1-D tensors, in `reduce_dtype`."""
    whole_gradients: str | None = None
    """Why it needs every rank's whole gradients, if it does: the plan then refuses ZeRO-2/3 (a shard of each)."""


def approximation_rank(rows: int, cols: int, cfg: GradCompressionConfig) -> int | None:
    """The rank a rows x cols gradient is compressed at, None when it is sent whole (torch's rule: compress
    when rows x cols exceeds min_compression_rate x (rows + cols) x r)."""
    r = min(cfg.rank, rows, cols)
    return r if rows * cols > cfg.min_compression_rate * (rows + cols) * r else None


def _powersgd(rows: int, cols: int, cfg: GradCompressionConfig, ranks: int) -> Compressed | None:
    r = approximation_rank(rows, cols, cfg)
    if r is None:
        return None
    return Compressed(sent=FP32 * (rows + cols) * r, kept=FP32 * (rows * cols + 2 * (rows + cols) * r))


TOPK_PAIR = 8
"""Bytes of one top-k element on the wire: its int32 index and its fp32 value."""


def topk_count(elements: int, ratio: float) -> int:
    """k of a matrix of `elements`: ceil(ratio x elements), at least 1, the ratio read as written (0.1 x 30 is 3,
    not the 4 that binary 0.1 would round up to)."""
    return max(1, min(elements, math.ceil(Fraction(repr(ratio)) * elements)))


def _topk(rows: int, cols: int, cfg: GradCompressionConfig, ranks: int) -> Compressed:
    sent = TOPK_PAIR * topk_count(rows * cols, cfg.ratio)
    return Compressed(sent=sent, kept=(FP32 * rows * cols if cfg.error_feedback else 0) + sent * (1 + ranks))


def qsgd_code_bits(levels: int) -> int:
    """Bits of one QSGD code: the signed level, offset to 0..2 x levels, in the smallest of 2, 4 or 8 bits that
    holds it (so that whole codes pack into a byte)."""
    needed = (2 * levels).bit_length()
    return next(bits for bits in (2, 4, 8) if bits >= needed)


def qsgd_bytes(elements: int, cfg: GradCompressionConfig) -> int:
    """Bytes a matrix of `elements` sends quantized: its codes packed (the last byte padded) and an fp32 norm per
    bucket of `bucket_size` elements."""
    return -(-elements * qsgd_code_bits(cfg.levels) // 8) + FP32 * -(-elements // cfg.bucket_size)


def _qsgd(rows: int, cols: int, cfg: GradCompressionConfig, ranks: int) -> Compressed:
    sent = qsgd_bytes(rows * cols, cfg)
    return Compressed(sent=sent, kept=sent * (1 + ranks))


COMPRESSIONS: dict[CompressionName, CompressionKind] = registry(COMPRESSION_NAMES, {
    "powersgd": CompressionKind(_powersgd, whole_gradients="it projects each gradient matrix and keeps its error "
                                                           "feedback whole"),
    "topk": CompressionKind(_topk, whole_gradients="it picks the largest elements of each whole gradient matrix and "
                                                   "keeps its residual whole"),
    "qsgd": CompressionKind(_qsgd, whole_gradients="it quantizes each whole gradient matrix against its norms"),
}, "the gradient compressors' facts")
"""The compressors by name (the spec's `parallel.grad_compression.kind`)."""
NAMES = tuple(COMPRESSIONS)
