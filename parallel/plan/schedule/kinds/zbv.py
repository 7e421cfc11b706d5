"""ZB-V (Qi et al. 2023, section 6; torch's ScheduleZBVZeroBubble): two chunks per rank in a V, backwards split."""

from __future__ import annotations

from trainyard.parallel.plan.schedule.kind import BI, BW, Compute, F, Schedule


def _zbv_order(pp: int, m: int, rank: int) -> list[Compute]:
    # ZB-V (the same paper, section 6; torch's ScheduleZBVZeroBubble, whose order this is): two chunks per rank
    # in a V (chunk 0 is virtual stage rank, chunk 1 stage 2pp-1-rank). Built for max(m, 2pp-1) micro-batches,
    # the fewest that fill the V, and the ones beyond m dropped, as torch does.
    n = max(2 * pp - 1, m)
    order: list[Compute] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        order.append((F, f0, 0))
        f0 += 1
    for _ in range(rank):
        order += [(F, f1, 1), (F, f0, 0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(pp - rank):
        order += [(F, f1, 1), (BI, b1, 1), (BW, b1, 1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            order.append((F, f0, 0))
            f0 += 1
        order += [(BI, b0, 0), (BW, b0, 0), (F, f1, 1), (BI, b1, 1), (BW, b1, 1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        order += [(BI, b0, 0), (BI, b1, 1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(pp - rank):
        order += [(BI, b0, 0), (BW, w0, 0)]
        b0, w0 = b0 + 1, w0 + 1
    order += [(BW, mb, 1) for mb in range(w1, b1)] + [(BW, mb, 0) for mb in range(w0, b0)]
    return [c for c in order if c[1] < m]


def _refuse_zbv(pp: int, m: int, vpp: int) -> str | None:
    if vpp != 2:
        return f"zbv needs vpp=2 (got vpp={vpp}): it places exactly two chunks per rank, in a V"
    return None


SCHEDULE = Schedule("zbv", lambda pp, m, vpp, rank: _zbv_order(pp, m, rank), _refuse_zbv, placement="v",
                    splits_backward=True)
