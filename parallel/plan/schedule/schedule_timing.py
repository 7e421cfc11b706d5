"""The schedule simulator's timing: a checked schedule (`CheckedSchedule`, its messages paired and its steps laid out
by `parallel.plan.schedule.schedule_sim.check`) run under `Costs` to a `SimResult` (makespan, bubble, peak activations,
timeline).

Computes take their cost; a maximal run of consecutive communication actions is posted at once and the rank
blocks until the peer has posted the matching op of every message in it, then the run takes `costs.comm`. If
some rank can never go on, that is a deadlock (ScheduleError naming each blocked rank and the op it waits for).
Where the ranks share cores (`costs.shared`), the run is timed as a fluid, event by event: a compute's speed
follows how many ranks compute at that moment. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.parallel.plan.schedule.actions import COMPUTE_KINDS, Action, ActionKind, ScheduleError

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
BI, BW = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


@dataclass(frozen=True)
class Costs:
    forward: float = 1.0
    """One forward of one chunk."""
    backward: float = 2.0
    """One whole backward of one chunk (B)."""
    comm: float = 0.0
    """One communication run (its messages travel concurrently)."""
    backward_weight: float | None = None
    """The weight-gradient part of a split backward (W; None: half of `backward`); its input-gradient part
    (I) takes the rest of `backward`."""
    shared: tuple[float, ...] = ()
    """Where the pipeline's ranks share cores: a compute's time with k ranks computing at once (index k - 1) as a
    multiple of the time above, which is its time with every rank computing (the last entry, 1). A compute then
    runs at the speed of how many compute beside it, moment by moment; () (each rank has a device of its own):
    every compute takes its time above."""

    def __post_init__(self) -> None:
        if any(not f > 0 for f in self.shared):  # NaN too
            raise ValueError(f"Costs.shared holds time multiples, each above 0: got {self.shared}")

    def of(self, kind: ActionKind) -> float:
        """The time of one compute of this kind."""
        weight = self.backward / 2 if self.backward_weight is None else self.backward_weight
        return {F: self.forward, B: self.backward, BI: self.backward - weight, BW: weight}[kind]


@dataclass(frozen=True)
class SimResult:
    makespan: float
    bubble_fraction: float
    """1 - total compute time / (pp * makespan)."""
    peak_activations: list[int]
    """Per pp rank: most (micro-batch, chunk) activations held at once (forward done, B or W not yet)."""
    timeline: list[list[tuple[float, float, Action]]]
    """Per pp rank: (start, end, action) of each compute, and of each communication action when comm > 0."""


@dataclass(frozen=True)
class CheckedSchedule:
    """A schedule that passed the static checks, its messages paired and its steps laid out: timed under any
    costs by `run`."""

    stages: list[list[Action]]
    partners: dict[tuple[int, int], tuple[int, int]]
    peaks: list[int]
    steps: list[list[tuple[int, int]]]
    """Per rank, its steps' (first, last + 1) positions: one compute, or a maximal run of communications."""
    waits: list[list[list[tuple[int, int]] | None]]
    """Per rank and step: None (a compute), or the (peer rank, peer step) each of its messages is matched at."""

    def run(self, costs: Costs = Costs(), timeline: bool = True) -> SimResult:
        """The schedule timed under `costs`; `timeline=False`: the makespan and bubble only (no Gantt rows)."""
        return _execute(self, costs, timeline)


def _execute(checked: CheckedSchedule, costs: Costs, keep_timeline: bool = True) -> SimResult:
    if any(f != 1.0 for f in costs.shared):
        return _execute_shared(checked, costs, keep_timeline)
    stages, steps, waits = checked.stages, checked.steps, checked.waits
    pp = len(stages)
    took = {kind: costs.of(kind) for kind in COMPUTE_KINDS}
    reached: list[list[float]] = [[0.0] for _ in range(pp)]  # when each rank reached each of its steps so far
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]
    compute = 0.0

    # Each rank runs until a communication step finds a peer that has not posted its side yet; it then waits on
    # that peer's step and is woken when the peer reaches it. Every step is timed once, and the times do not
    # depend on the order ranks are taken in (a step's start is the latest of what it waits for).
    ready, asleep = list(range(pp)), dict[tuple[int, int], list[int]]()
    while ready:
        rank = ready.pop()
        mine, row = reached[rank], timeline[rank]
        while len(mine) <= len(steps[rank]):
            now = mine[-1]
            lo, hi = steps[rank][len(mine) - 1]
            matched = waits[rank][len(mine) - 1]
            if matched is not None:
                missing = _unposted(matched, reached)
                if missing is not None:
                    asleep.setdefault(missing, []).append(rank)
                    break
                start = max(now, *(reached[peer][peer_step] for peer, peer_step in matched))
                end = start + costs.comm
                if costs.comm > 0 and keep_timeline:
                    row += [(start, end, a) for a in stages[rank][lo:hi]]
            else:
                action = stages[rank][lo]
                end = now + took[action.kind]
                compute += end - now
                if keep_timeline:
                    row.append((now, end, action))
            mine.append(end)
            ready += asleep.pop((rank, len(mine) - 1), ())

    return _result(checked, reached, compute, timeline)


def _execute_shared(checked: CheckedSchedule, costs: Costs, keep_timeline: bool = True) -> SimResult:
    """`_execute` where the ranks share cores: between two events (a compute or a communication run ending) the
    k ranks computing each progress at 1 / costs.shared[k - 1] of their full-occupancy time per second."""
    stages, steps, waits = checked.stages, checked.steps, checked.waits
    pp = len(stages)
    took = {kind: costs.of(kind) for kind in COMPUTE_KINDS}
    factor = [*costs.shared, *[costs.shared[-1]] * max(pp - len(costs.shared), 0)]
    reached: list[list[float]] = [[0.0] for _ in range(pp)]
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]
    left: dict[int, float] = {}  # rank -> the work its compute has left, in full-occupancy seconds
    comm_end: dict[int, float] = {}  # rank -> when its communication run ends
    asleep: dict[tuple[int, int], list[int]] = {}
    now, compute = 0.0, 0.0

    def start(rank: int) -> None:  # the rank has reached its next step at `now`: begin it, or wait for a peer
        step = len(reached[rank]) - 1
        if step >= len(steps[rank]):
            return
        matched = waits[rank][step]
        if matched is None:
            left[rank] = took[stages[rank][steps[rank][step][0]].kind]
            return
        missing = _unposted(matched, reached)
        if missing is not None:
            asleep.setdefault(missing, []).append(rank)
        else:
            comm_end[rank] = now + costs.comm

    for rank in range(pp):
        start(rank)
    while left or comm_end:
        slow = factor[len(left) - 1] if left else 1.0
        first = min(left.values(), default=float("inf"))
        until = min(now + first * slow, min(comm_end.values(), default=float("inf")))
        progress = (until - now) / slow
        done = [r for r, e in comm_end.items() if e <= until]
        done += [r for r, w in left.items() if w - progress <= 1e-12 * max(w, 1.0)]
        for rank in list(left):
            left[rank] -= progress
        now = until
        for rank in done:
            lo, hi = steps[rank][len(reached[rank]) - 1]
            began = reached[rank][-1]
            if comm_end.pop(rank, None) is None:
                del left[rank]
                compute += now - began
                if keep_timeline:
                    timeline[rank].append((began, now, stages[rank][lo]))
            elif costs.comm > 0 and keep_timeline:
                timeline[rank] += [(now - costs.comm, now, a) for a in stages[rank][lo:hi]]
            reached[rank].append(now)
        for rank in done:
            for woken in [rank, *asleep.pop((rank, len(reached[rank]) - 1), ())]:
                start(woken)

    return _result(checked, reached, compute, timeline)


def _unposted(matched: list[tuple[int, int]], reached: list[list[float]]) -> tuple[int, int] | None:
    """The first (peer rank, peer step) of a communication run's messages that the peer has not reached yet."""
    return next((ps for ps in matched if ps[1] >= len(reached[ps[0]])), None)


def _result(checked: CheckedSchedule, reached: list[list[float]], compute: float,
            timeline: list[list[tuple[float, float, Action]]]) -> SimResult:
    """The timed run's result (`compute`: the seconds the ranks spent computing), or ScheduleError on a deadlock."""
    _raise_if_blocked(checked, reached)
    makespan = max(times[-1] for times in reached)
    bubble = 1.0 - compute / (len(reached) * makespan) if makespan > 0 else 0.0
    return SimResult(makespan, bubble, checked.peaks, timeline)


def _raise_if_blocked(checked: CheckedSchedule, reached: list[list[float]]) -> None:
    """ScheduleError naming every rank that never got past a communication run, and the op it waits for."""
    stages, steps, waits = checked.stages, checked.steps, checked.waits
    blocked = [rank for rank in range(len(stages)) if len(reached[rank]) <= len(steps[rank])]
    if blocked:
        found = []
        for rank in blocked:
            lo, hi = steps[rank][len(reached[rank]) - 1]
            matched = waits[rank][len(reached[rank]) - 1]
            assert matched is not None, rank  # a rank blocks at a communication step only
            pos = next(pos for pos, (peer, peer_step) in zip(range(lo, hi), matched, strict=True)
                       if peer_step >= len(reached[peer]))
            peer, peer_pos = checked.partners[(rank, pos)]
            found.append(f"rank {rank} waits forever at position {pos} ({stages[rank][pos]}) for rank "
                         f"{peer}, whose matching op is at its position {peer_pos} "
                         f"({stages[peer][peer_pos]})")
        raise ScheduleError("deadlock: " + "; ".join(found))
