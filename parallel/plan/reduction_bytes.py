"""Bytes a rank sends per step over its gradient reductions, plain and with gradient compression.

`reduction_bytes(plan)` is what `trainyard plan` shows (`parallel.plan.present`) and what a step's metrics row
measures (`reduce_bytes`, the payload a rank hands to its reduction collectives: a ring all-reduce moves
about twice that over the wire, a reduce-scatter about once). Each reduction set (dense parameters over one
replica's dp ranks, routers over the stage, experts over the ranks holding the same ones:
`parallel.plan.reduction_sets`, which the runtime and the memory plan read too) sends its local gradients in
`reduce_dtype`, or nothing when no other rank shares it. With gradient compression (`parallel.grad_compression`),
each matrix the compressor compresses sends what its entry in `parallel.plan.grad_compression.COMPRESSIONS` says
(PowerSGD: its two fp32 factors P, rows x r, and Q, cols x r; top-k: k index and value pairs; QSGD: packed codes
and norms) instead, and every other tensor goes whole. Shapes
come from the model's family (`ModelFamily.matrices`); with `model.lora` only the adapters have gradients, so
only they are reduced. Pure arithmetic: no torch.
"""

from __future__ import annotations

from trainyard.parallel.models.base import Matrix
from trainyard.parallel.models.counting import BF16, FP32
from trainyard.parallel.plan.reduction_sets import group_sizes, shared_sets
from trainyard.parallel.plan.schedule.actions import virtual_stage
from trainyard.parallel.plan.sizing import Sizing
from trainyard.parallel.plan.units import format_bytes


def _stage_matrices(plan: Sizing, pp: int):
    """(matrix elements of shared sets, [(rows, cols, set)] of those matrices, elements per shared set) of
    a pipeline rank's chunks."""
    cfg, family, shared = plan.config, plan.family, shared_sets(plan.layout)
    elements, matrices = 0, []
    if cfg.model.lora is not None:  # the frozen base has no gradient: only the adapters (dense) are reduced
        if "dense" not in shared:
            return 0, []
        for layers in plan.chunk_layers(pp):
            elements += family.adapter_elements(cfg.model, layers, tp=plan.tp)
            matrices += _adapter_matrices(plan, layers)
        return elements, matrices
    for c, layers in enumerate(plan.chunk_layers(pp)):
        v = virtual_stage(pp, c, plan.pp, plan.placement)
        kw = {"first": v == 0, "last": v == plan.n_virtual_stages - 1, "tp": plan.tp, "ep": plan.ep}
        counts = family.param_counts(cfg.model, layers, **kw)
        elements += sum(n for s, n in (("dense", counts.dense), ("router", counts.router),
                                       ("experts", counts.experts)) if s in shared)
        matrices += [m for m in family.matrices(cfg.model, layers, **kw) if m[2] in shared]
    return elements, matrices


def _adapter_matrices(plan: Sizing, layers: list[int]) -> list[Matrix]:
    """The local shapes of blocks `layers`' LoRA adapters, A (rank x in) and B (out x rank), the one tp splits as
    its base projection is split (`ModelFamily.adapter_elements` counts the same)."""
    m, family = plan.config.model, plan.family
    assert m.lora is not None
    shapes, r = family.lora_shapes(m), m.lora.rank
    out: list[Matrix] = []
    for block in layers:
        for target in m.lora.targets:
            if m.is_moe_block(block) and family.lora_targets[target].startswith("mlp."):
                continue
            n_in, n_out, rowwise = shapes[target]
            out += [(r, n_in // plan.tp if rowwise else n_in, "dense"), (n_out if rowwise else n_out // plan.tp, r,
                                                                         "dense")]
    return out


def compression_state_bytes(plan: Sizing, pp: int) -> int:
    """What the gradient compressor keeps on a rank of pipeline stage `pp` beside the gradient buckets: what it
    keeps for each matrix it compresses (`Compressed.kept`; PowerSGD: the error, rows x cols, and the factors P and
    Q with their packed copies on the wire, fp32; top-k its residual and the pairs, its own and the group's
    gathered; QSGD its codes and the group's), and the packed copy of the tensors sent whole."""
    compression, compressor = plan.parallel.grad_compression, plan.compression
    if compression is None or compressor is None:
        return 0
    elements, matrices = _stage_matrices(plan, pp)
    kept = whole = 0
    sizes = group_sizes(plan.layout)
    for rows, cols, reduction_set in matrices:
        c = compressor.matrix(rows, cols, compression, sizes[reduction_set])
        if c is not None:
            kept += c.kept
            whole += rows * cols
    wire = BF16 if plan.parallel.reduce_dtype == "bf16" else FP32
    return kept + wire * (elements - whole) if kept else 0


def reduction_bytes(plan: Sizing) -> dict:
    """Per pipeline stage, the bytes one of its ranks sends per step: `uncompressed` (plain, in
    reduce_dtype) and `sent` (with the job's compression after its warm-up; equal without one)."""
    par = plan.parallel
    compression, wire = par.grad_compression, BF16 if par.reduce_dtype == "bf16" else FP32
    # ZeRO-2/3 (FSDP2) reduce-scatter a chunk's gradients at each of its backwards: once per micro-batch.
    per_step = par.microbatches if plan.sharding.reduces_every_microbatch else 1
    stages = []
    for pp in range(plan.pp):
        elements, matrices = _stage_matrices(plan, pp)
        plain = sent = wire * elements * per_step
        if compression is not None and (compressor := plan.compression) is not None:
            sizes = group_sizes(plan.layout)
            for rows, cols, reduction_set in matrices:
                c = compressor.matrix(rows, cols, compression, sizes[reduction_set])
                if c is not None:
                    sent += c.sent - wire * rows * cols
        stages.append({"uncompressed": plain, "sent": sent})
    return {"compression": None if compression is None else compression.kind, "per_stage": stages}


def format_reduction(reduction: dict) -> list[str]:
    """`trainyard plan`'s lines for `reduction_bytes`: what a rank of each stage sends per step."""
    stages = reduction["per_stage"]
    if not any(s["uncompressed"] for s in stages):
        return ["gradient reduction: none (no other rank shares a gradient)"]
    kind = reduction["compression"]
    per_stage = "  ".join(
        f"stage {i}: {format_bytes(s['sent'])}" + (f" (uncompressed {format_bytes(s['uncompressed'])}, "
                                                   f"{s['sent'] / s['uncompressed']:.1%})" if kind else "")
        for i, s in enumerate(stages))
    return [f"gradient reduction per step and rank{f' ({kind}, after its warm-up)' if kind else ''}: {per_stage}"]

