"""1F1B (PipeDream-Flush, Narayanan et al. 2021): a warm-up of forwards, then one forward and one backward
in turn, so a rank holds at most pp activations."""

from __future__ import annotations

from trainyard.parallel.plan.schedule.kind import B, Compute, F, Schedule


def _one_f_one_b_order(pp: int, m: int, rank: int) -> list[Compute]:
    warmup = min(pp - rank - 1, m)
    order: list[Compute] = [(F, mb, 0) for mb in range(warmup)]
    for i in range(m - warmup):
        order += [(F, warmup + i, 0), (B, i, 0)]
    return order + [(B, mb, 0) for mb in range(m - warmup, m)]


def _refuse_1f1b(pp: int, m: int, vpp: int) -> str | None:
    if vpp != 1:
        return f"1f1b needs vpp=1 (got vpp={vpp}); use interleaved-1f1b for virtual stages"
    return None


SCHEDULE = Schedule("1f1b", lambda pp, m, vpp, rank: _one_f_one_b_order(pp, m, rank), _refuse_1f1b)
