"""What the plan knows of each gradient compressor (`parallel.grad_compression.kind`), pure (no torch): what a
gradient matrix costs compressed, the bytes it sends per step and the bytes it keeps on the rank, and whether the
compressor needs every rank's whole gradients. `reduction_bytes` (what a step sends) and the memory plan
(`compression_state_bytes`) read it, and the rules refuse ZeRO-2/3 with a compressor that needs whole gradients.
How a compressor runs on a rank is `parallel.runtime.compression.COMPRESSORS`, under the same names
(tests/unit/test_grads.py holds the two equal).

- `powersgd` (Vogels et al. 2019, `parallel.runtime.compression.powersgd`): a matrix large enough to gain
  (`approximation_rank`, torch's rule) sends two fp32 factors, P (rows x r) and Q (cols x r), and keeps its error
  (rows x cols) and the factors with their packed copies on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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

    matrix: Callable[[int, int, GradCompressionConfig], Compressed | None]
    """What a rows x cols gradient matrix (a parameter's local gradient, more dimensions flattened after the first)
    costs compressed; None: it is sent whole, packed in one buffer with the 1-D tensors, in `reduce_dtype`."""
    whole_gradients: str | None = None
    """Why it needs every rank's whole gradients, if it does: the plan then refuses ZeRO-2/3 (a shard of each)."""


def approximation_rank(rows: int, cols: int, cfg: GradCompressionConfig) -> int | None:
    """The rank a rows x cols gradient is compressed at, None when it is sent whole (torch's rule: compress
    when rows x cols exceeds min_compression_rate x (rows + cols) x r)."""
    r = min(cfg.rank, rows, cols)
    return r if rows * cols > cfg.min_compression_rate * (rows + cols) * r else None


def _powersgd(rows: int, cols: int, cfg: GradCompressionConfig) -> Compressed | None:
    r = approximation_rank(rows, cols, cfg)
    if r is None:
        return None
    return Compressed(sent=FP32 * (rows + cols) * r, kept=FP32 * (rows * cols + 2 * (rows + cols) * r))


COMPRESSIONS: dict[CompressionName, CompressionKind] = registry(COMPRESSION_NAMES, {
    "powersgd": CompressionKind(_powersgd, whole_gradients="it projects each gradient matrix and keeps its error "
                                                           "feedback whole"),
}, "the gradient compressors' facts")
"""The compressors by name (the spec's `parallel.grad_compression.kind`)."""
NAMES = tuple(COMPRESSIONS)
