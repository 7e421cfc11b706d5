"""Bytes a rank sends per step over its gradient reductions, plain and with gradient compression.

`reduction_bytes(plan)` is what `trainyard plan` shows (`parallel.present`) and what a step's metrics row
measures (`reduce_bytes`, the payload a rank hands to its reduction collectives: a ring all-reduce moves
about twice that over the wire, a reduce-scatter about once). Each reduction set (dense parameters over
dp, routers over the stage, experts over the ranks holding the same ones; see `parallel.memory`) sends its
local gradients in `reduce_dtype`, or nothing when no other rank shares it. With PowerSGD
(`parallel.grad_compression`), each matrix it compresses (`approximation_rank`, torch's rule) sends its two
fp32 factors P (rows x r) and Q (cols x r) instead, and every other tensor goes whole. Shapes come from the
model's family (`ModelFamily.matrices`). Pure arithmetic: no torch.
"""

from __future__ import annotations

from trainyard.parallel.config import GradCompressionConfig
from trainyard.parallel.models import family_of
from trainyard.parallel.models.counting import BF16, FP32
from trainyard.parallel.schedules import virtual_stage
from trainyard.parallel.sizing import Sizing


def approximation_rank(rows: int, cols: int, cfg: GradCompressionConfig) -> int | None:
    """The rank a rows x cols gradient is compressed at, None when it is sent whole (torch's rule: compress
    when rows x cols exceeds min_compression_rate x (rows + cols) x r)."""
    r = min(cfg.rank, rows, cols)
    return r if rows * cols > cfg.min_compression_rate * (rows + cols) * r else None


def reduction_bytes(plan: Sizing) -> dict:
    """Per pipeline stage, the bytes one of its ranks sends per step: `uncompressed` (plain, in
    reduce_dtype) and `sent` (with the job's compression after its warm-up; equal without one)."""
    cfg = plan.config
    compression = cfg.parallel.grad_compression
    wire = BF16 if cfg.parallel.reduce_dtype == "bf16" else FP32
    group = {"dense": plan.dp, "router": plan.dp * plan.tp, "experts": plan.dp // plan.ep * plan.tp}
    family, stages = family_of(cfg.model), []
    for pp in range(plan.pp):
        plain = sent = 0
        for c, layers in enumerate(plan.chunk_layers(pp)):
            v = virtual_stage(pp, c, plan.pp)
            kw = {"first": v == 0, "last": v == plan.n_virtual_stages - 1, "tp": plan.tp, "ep": plan.ep}
            counts = family.param_counts(cfg.model, layers, **kw)
            elements = {"dense": counts.dense, "router": counts.router, "experts": counts.experts}
            shared = {s for s, n in group.items() if n > 1}
            plain += wire * sum(elements[s] for s in shared)
            sent += wire * sum(elements[s] for s in shared)
            if compression is None:
                continue
            for rows, cols, kind in family.matrices(cfg.model, layers, **kw):
                r = approximation_rank(rows, cols, compression)
                if kind in shared and r is not None:
                    sent += FP32 * (rows + cols) * r - wire * rows * cols
        stages.append({"uncompressed": plain, "sent": sent})
    return {"compression": None if compression is None else compression.kind, "per_stage": stages}
