"""Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): vpp chunks per rank, micro-batches in groups of at
least pp, a shorter bubble for more messages."""

from __future__ import annotations

from trainyard.parallel.plan.schedule.actions import ScheduleError
from trainyard.parallel.plan.schedule.kind import B, Compute, F, Schedule


def _group_size(pp: int, m: int) -> int:
    """Micro-batches that go through one chunk before the rank moves to the next chunk.

    Megatron-LM's rule: a group holds at least pp micro-batches, or the first rank waits for the
    wrapped-around activation; groups are equal, except a last, smaller one that must itself hold at least
    pp. The smallest such size keeps the fewest activations in flight (it sets the warm-up length).
    """
    for size in range(pp, m + 1):
        if m % size == 0 or m % size >= pp:
            return size
    raise ScheduleError(f"interleaved-1f1b needs microbatches >= pp (got microbatches={m}, pp={pp})")


def _interleaved_order(pp: int, m: int, vpp: int, rank: int) -> list[Compute]:
    group = _group_size(pp, m)
    table = [(mb, c) for start in range(0, m, group) for c in range(vpp)
             for mb in range(start, min(start + group, m))]
    forwards = [(F, mb, c) for mb, c in table]
    backwards = [(B, mb, vpp - 1 - c) for mb, c in table]
    total = len(table)
    # Later ranks start 1F1B sooner: each rank keeps two more forwards in flight than the next one, to cover
    # the round trip of the first backward (Megatron's warm-up count).
    warmup = min(2 * (pp - rank - 1) + (vpp - 1) * group, total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[total - warmup:]


def _refuse_interleaved(pp: int, m: int, vpp: int) -> str | None:
    if vpp < 2:
        return f"interleaved-1f1b needs vpp >= 2 (got vpp={vpp}); use 1f1b for one chunk per rank"
    if pp < 2:
        return (f"interleaved-1f1b needs pp >= 2 (got pp={pp}): with one pipeline rank there is nothing to "
                "interleave; use 1f1b or gpipe")
    if m < pp:
        return (f"interleaved-1f1b needs microbatches >= pp (got microbatches={m}, pp={pp}): a group of "
                "micro-batches must fill the pipeline before it wraps around to the next chunk; with fewer, "
                "every activation is held at once anyway, and gpipe with the same vpp runs that schedule")
    return None


SCHEDULE = Schedule("interleaved-1f1b", _interleaved_order, _refuse_interleaved)
