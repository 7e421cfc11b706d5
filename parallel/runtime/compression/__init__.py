"""The gradient compression room: compressors of the data-parallel reduction (`parallel.grad_compression`).

Owns the registry of compressors (`COMPRESSORS`, by the spec's `parallel.grad_compression.kind`) and one module per
compressor (`powersgd`, `topk`, `qsgd`; the last two share the reducer of `gathered`, which all-gathers each rank's
codes and sums them decoded). Every compressor and its reducers build on `base` (warm-up, the uncompressed rest,
ZeRO-1's slice, the bytes sent). A compressor is a `Compressor` (`parallel.runtime.dp.data_parallel`, where
`make_reducer` calls it, and re-exported here: its reducers subclass that module's, so the protocol lives beside them):
the step running now, which the trainer sets before each step, and `reducer_class(base)`, the compressing variant of a
sharding strategy's reducer class. The trainer builds the job's (`make_compressor`) and hands it to `make_reducer` for
every reduction set. What a compressor sends and keeps, and whether it needs whole gradients, are its pure facts in
`parallel.plan.grad_compression.COMPRESSIONS`, under the same names.
"""

from __future__ import annotations

from collections.abc import Callable

from trainyard.parallel.config import GradCompressionConfig
from trainyard.parallel.names import COMPRESSION_NAMES, CompressionName, registry
from trainyard.parallel.runtime.compression.powersgd import PowerSGD
from trainyard.parallel.runtime.compression.qsgd import QSGD
from trainyard.parallel.runtime.compression.topk import TopK
from trainyard.parallel.runtime.dp.data_parallel import Compressor

__all__ = ["COMPRESSORS", "NAMES", "Compressor", "make_compressor"]

COMPRESSORS: dict[CompressionName, Callable[[GradCompressionConfig, int], Compressor]] = registry(COMPRESSION_NAMES, {
    "powersgd": PowerSGD,
    "topk": TopK,
    "qsgd": QSGD,
}, "the gradient compressors")
"""The compressors by name, each built from (its config, the job's seed)."""
NAMES = tuple(COMPRESSORS)


def make_compressor(cfg: GradCompressionConfig | None, seed: int) -> Compressor | None:
    """The job's compressor (None: the gradients go uncompressed)."""
    return None if cfg is None else COMPRESSORS[cfg.kind](cfg, seed)
