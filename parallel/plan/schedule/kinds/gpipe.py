"""GPipe (Huang et al. 2019): every forward, then every backward; with vpp > 1, chunk by chunk (the
breadth-first "looped" schedule)."""

from __future__ import annotations

from trainyard.parallel.plan.schedule.kind import B, Compute, F, Schedule


def _gpipe_order(m: int, vpp: int) -> list[Compute]:
    # All forwards chunk by chunk, then all backwards in reverse chunk order (with vpp > 1 this is the
    # breadth-first "looped" schedule: the same bubble as interleaved, but every activation is held at once).
    forwards = [(F, mb, c) for c in range(vpp) for mb in range(m)]
    backwards = [(B, mb, c) for c in reversed(range(vpp)) for mb in range(m)]
    return forwards + backwards


SCHEDULE = Schedule("gpipe", lambda pp, m, vpp, rank: _gpipe_order(m, vpp))
