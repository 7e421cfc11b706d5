"""The memory plan's ZeRO-2/3 terms: what FSDP2 holds gathered whole at a rank's peak, and the largest unit's whole
gradient before its reduce-scatter (`parallel.plan.memory.estimate` adds them to a rank's parameters and its step's
peak).

A rank's FSDP2 units are its chunks' embedding, blocks and head, as `DecoderStage.shard_units` makes them; the
gathers are walked over the rank's computes in its schedule's order (`parallel.runtime.dp.fsdp` gathers one unit
ahead; `peak_gathered_bytes` measures the pair). Pure arithmetic: no torch.
"""

from __future__ import annotations

from trainyard.parallel.models.counting import FP32, ParamCounts, by_block_kind
from trainyard.parallel.plan.reduction_sets import reduced_sets
from trainyard.parallel.plan.schedule.actions import COMPUTE_KINDS, Action, ActionKind, virtual_stage
from trainyard.parallel.plan.sizing import Sizing


def gathered_bytes(plan: Sizing, pp_rank: int) -> int:
    """fp32 bytes of parameters FSDP2 holds gathered whole at the step's peak, besides the shards (0 below
    ZeRO-2): ZeRO-2 every unit of every chunk; ZeRO-3 per block (a chunk in a zb schedule's split backward): the
    unit computing and the next one's gather in flight, walked over the rank's computes in the schedule's order
    (the pair that crosses from one compute to the next included), and a unit that runs twice in one forward (tied
    embeddings) held in between. A block is counted with its MoE router and experts, which FSDP2 gathers one
    module at a time inside it: for an MoE block this is a bound."""
    sharding = plan.sharding
    if not sharding.shards_parameters:
        return 0
    units = _shard_units(plan, pp_rank)
    backward = [units[::-1] for units in units]
    passes = [units[a.chunk] if a.kind is ActionKind.FORWARD else backward[a.chunk]
              for a in plan.actions[pp_rank] if a.kind in COMPUTE_KINDS and not _split(plan, pp_rank, a)]
    split = {a.chunk for a in plan.actions[pp_rank]
             if a.kind is ActionKind.BACKWARD_WEIGHT and _split(plan, pp_rank, a)}
    if not sharding.reshard_after_forward or not split:
        return FP32 * sharding.gathered_elements(passes)  # ZeRO-2 holds every unit all step anyway
    # ZeRO-3 under a zb schedule: either half of a split backward gathers its chunk's units all at once
    # (`parallel.runtime.dp.fsdp_split`) and FSDP2 frees them before the next compute gathers anything but the
    # unit the input half ran last with the next one's first: the peak is a whole chunk, or the per-block walk of
    # the other computes (the halves left out of it), whichever is larger.
    return FP32 * max(sharding.gathered_elements(passes), *(sum(dict(units[c]).values()) for c in split))


def _split(plan: Sizing, pp_rank: int, a: Action) -> bool:
    """A half of a split backward that is not a whole backward: not at virtual stage 0 (whose input half computes
    nothing and whose weight half is the whole backward, through FSDP2's hooks as any backward)."""
    if a.kind is ActionKind.BACKWARD_INPUT:
        return True  # at virtual stage 0 it computes nothing: left out of the walk either way
    return a.kind is ActionKind.BACKWARD_WEIGHT and virtual_stage(pp_rank, a.chunk, plan.pp, plan.placement) > 0


def largest_unit_grad_bytes(plan: Sizing, pp_rank: int) -> int:
    """fp32 bytes of the largest FSDP2 unit's sharded parameters, whole: its gradient before the reduce-scatter, the
    transient the backward of that unit adds to the step's peak (0 below ZeRO-2, which reduce from buckets the
    gradients count already)."""
    if not plan.sharding.shards_parameters:
        return 0
    return FP32 * max((n for units in _shard_units(plan, pp_rank) for _, n in units), default=0)


def _shard_units(plan: Sizing, pp_rank: int) -> list[list[tuple[tuple[int, str], int]]]:
    """Each chunk's FSDP2 units in the order its forward runs them, as `DecoderStage.shard_units` makes them
    (the embedding, each block, the head; tied embeddings one unit, first and last), each as ((chunk, name),
    its local parameter elements that are sharded: the sets reduced over more than this rank)."""
    m, family = plan.config.model, plan.family

    def sharded(layers: tuple[int, ...], first: bool, last: bool) -> int:
        counts = family.param_counts(m, layers, first=first, last=last, tp=plan.tp, ep=plan.ep)
        counts += ParamCounts(dense=family.adapter_elements(m, layers, tp=plan.tp), router=0, experts=0)
        return sum(n for n, size in reduced_sets(plan.layout, counts) if size > 1)

    per_kind = by_block_kind(m, lambda i: sharded((i,), False, False))
    out = []
    for c, layers in enumerate(plan.chunk_layers(pp_rank)):
        v = virtual_stage(pp_rank, c, plan.pp, plan.placement)
        first, last = v == 0, v == plan.n_virtual_stages - 1
        blocks = [((c, f"block {i}"), per_kind(i)) for i in layers]
        if first and last and m.tie_embeddings:
            tied = ((c, "embedding and head"), sharded((), True, True))
            out.append([tied, *blocks, tied])
            continue
        out.append(([((c, "embedding"), sharded((), True, False))] if first else []) + blocks
                   + ([((c, "head"), sharded((), False, True))] if last else []))
    return out
