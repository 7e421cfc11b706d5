"""ZB-H1 (Qi et al. 2023): 1F1B with each backward split into its input and weight halves, the weight halves
filling the cool-down."""

from __future__ import annotations

from trainyard.parallel.plan.schedule.kind import BI, BW, Compute, F, Schedule


def _zb_h1_order(pp: int, m: int, rank: int) -> list[Compute]:
    # ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", the handcrafted schedule with 1F1B's memory):
    # 1F1B's warm-up, then each backward split into I and W; rank r defers the W of its first r micro-batches,
    # which fill the cool-down where 1F1B idles. The same order as torch's ScheduleInterleavedZeroBubble with
    # one chunk per rank. Each rank holds at most pp activations (an activation is held until its W).
    warmup = min(pp - rank - 1, m)
    order: list[Compute] = [(F, mb, 0) for mb in range(warmup)]
    weights = 0
    for i in range(m):
        if warmup + i < m:
            order.append((F, warmup + i, 0))
        order.append((BI, i, 0))
        if i >= rank:
            order.append((BW, weights, 0))
            weights += 1
    return order + [(BW, mb, 0) for mb in range(weights, m)]


def _refuse_zb_h1(pp: int, m: int, vpp: int) -> str | None:
    if vpp != 1:
        return f"zb-h1 needs vpp=1 (got vpp={vpp}); zbv runs two chunks per rank"
    return None


SCHEDULE = Schedule("zb-h1", lambda pp, m, vpp, rank: _zb_h1_order(pp, m, rank), _refuse_zb_h1, splits_backward=True)
