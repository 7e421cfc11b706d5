"""Schedule simulator: proves a set of per-rank action lists valid and deadlock-free, and times it.

`simulate(stages, microbatches, vpp, costs, placement)` takes one action list per pipeline rank (from
`parallel.plan.schedule.schedules.build_schedule`, or written by hand) and checks, in order:

1. each rank on its own: every (micro-batch, chunk) is forwarded and backwarded exactly once (a whole B, or a
   split one: I then W), the backward after its forward, every input is on hand before the compute that needs
   it, every message goes to or comes from the rank that holds the neighbouring virtual stage, and every
   output that must leave the rank is sent exactly once;
2. each channel src -> dst: the k-th send and the k-th receive carry the same payload (point-to-point
   messages match first-in-first-out, with no tags);
3. the run: computes take their cost; a maximal run of consecutive communication actions is posted at once
   and the rank blocks until the peer has posted the matching op of every message in it, then the run takes
   `costs.comm` (its messages travel concurrently). If some rank can never go on, that is a deadlock. Where
   the ranks share cores (`costs.shared`), a compute's speed follows how many ranks compute at that moment:
   the run is then timed as a fluid, event by event, and a rank idle in the bubble lends the others its core.

This module owns the checks (steps 1 and 2: `check` returns the `CheckedSchedule` any costs time), `simulate` and
`render_gantt` (the result as text); the run (step 3) is `parallel.plan.schedule.schedule_timing`'s. Any failure raises
ScheduleError naming the rank, the position in its list and the action. Pure: no torch.
"""

from __future__ import annotations

from trainyard.parallel.plan.schedule.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    FREEING_KINDS,
    INPUT_GRAD_KINDS,
    SEND_KINDS,
    Action,
    ActionKind,
    ScheduleError,
    stage_location,
    virtual_stage,
)
from trainyard.parallel.plan.schedule.schedule_timing import CheckedSchedule, Costs, SimResult

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
BI, BW = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_INPUT_OF = {F: ActionKind.RECV_ACT, B: ActionKind.RECV_GRAD, BI: ActionKind.RECV_GRAD}  # from a remote neighbour
_SENT_AFTER = {ActionKind.SEND_ACT: {F}, ActionKind.SEND_GRAD: INPUT_GRAD_KINDS}  # one must be done before the send


def simulate(stages: list[list[Action]], microbatches: int, vpp: int = 1,
             costs: Costs = Costs(), placement: str = "interleaved") -> SimResult:
    """Check the per-rank lists (index = pp rank) and time them; ScheduleError on the first fault. `placement`
    is how virtual stages sit on the ranks (`parallel.plan.schedule.actions.virtual_stage`; `placement_of(kind)`)."""
    return check(stages, microbatches, vpp, placement).run(costs)


def steady_state(stages: list[list[Action]], twice: list[list[Action]], microbatches: int,
                 costs: Costs = Costs()) -> tuple[float, float]:
    """(time per step, bubble fraction) of a schedule that does not flush between steps (2bw), in steady state:
    `stages` is one step's lists and `twice` the same schedule over two steps' micro-batches back to back (what
    the ranks run when a step's forwards start as the last one's backwards drain); a step then costs the
    difference, and its bubble is what of that difference the ranks do not compute. Both lists are checked
    (`simulate`)."""
    once, both = simulate(stages, microbatches, costs=costs), simulate(twice, 2 * microbatches, costs=costs)
    per_step = both.makespan - once.makespan
    compute = microbatches * (costs.forward + costs.backward)  # per rank, one F and one B per micro-batch
    return per_step, max(0.0, 1.0 - compute / per_step)


def check(stages: list[list[Action]], microbatches: int, vpp: int = 1,
          placement: str = "interleaved", verify: bool = True) -> CheckedSchedule:
    """The static checks of `simulate` (steps 1 and 2), once for a schedule timed under many costs. `verify=False` pairs
    the messages and lays out the steps only, for a schedule `parallel.plan.schedule.schedules` built (whose every kind
    its tests check): no peaks of live activations, and a faulty list may then time wrong."""
    if not stages:
        raise ScheduleError("a schedule needs at least one pipeline rank")
    peaks = [_check_rank(stages, rank, microbatches, vpp, placement) for rank in range(len(stages))] if verify else []
    partners = _match_channels(stages, placement, verify)
    steps = [_steps(actions) for actions in stages]
    step_of = [{pos: s for s, (lo, hi) in enumerate(rank_steps) for pos in range(lo, hi)} for rank_steps in steps]

    def matched(rank: int, lo: int, hi: int) -> list[tuple[int, int]] | None:
        if stages[rank][lo].kind not in COMM_KINDS:
            return None
        return [(peer, step_of[peer][peer_pos]) for peer, peer_pos in (partners[(rank, pos)] for pos in range(lo, hi))]

    waits = [[matched(rank, lo, hi) for lo, hi in steps[rank]] for rank in range(len(stages))]
    return CheckedSchedule(stages, partners, peaks, steps, waits)


def _check_rank(stages: list[list[Action]], rank: int, m: int, vpp: int, placement: str) -> int:
    """Static checks of one rank's list, in program order. Returns its peak of live activations."""
    pp, actions = len(stages), stages[rank]
    n_virtual = pp * vpp
    seen: set[tuple[ActionKind, int, int]] = set()
    live = peak = 0

    def fail(pos: int, action: Action, why: str) -> ScheduleError:
        return ScheduleError(f"rank {rank}, position {pos} ({action}): {why}")

    for pos, a in enumerate(actions):
        if not isinstance(a, Action):
            raise ScheduleError(f"rank {rank}, position {pos}: {a!r} is not an Action")
        if not (0 <= a.microbatch < m and 0 <= a.chunk < vpp):
            raise fail(pos, a, f"micro-batch or chunk out of range (microbatches={m}, vpp={vpp})")
        key = (a.kind, a.microbatch, a.chunk)
        if key in seen:
            raise fail(pos, a, f"duplicated {a.kind.name} of micro-batch {a.microbatch}, chunk {a.chunk}")
        v = virtual_stage(rank, a.chunk, pp, placement)
        if a.kind in COMM_KINDS:
            wrong_peer = _peer_problem(a, v, rank, pp, n_virtual, placement)
            if wrong_peer:
                raise fail(pos, a, wrong_peer)
            done_first = _SENT_AFTER.get(a.kind, set())
            if done_first and not any((k, a.microbatch, a.chunk) in seen for k in done_first):
                names = " or ".join(sorted(k.name for k in done_first))
                raise fail(pos, a, f"sends before its {names} has produced the tensor")
        else:
            if a.peer is not None:
                raise fail(pos, a, "a compute action takes no peer")
            if a.kind is not F and (F, a.microbatch, a.chunk) not in seen:
                raise fail(pos, a, f"{a.kind.name} before its FORWARD")
            other = {B: (BI, BW), BI: (B,), BW: (B,)}.get(a.kind, ())
            if any((k, a.microbatch, a.chunk) in seen for k in other):
                raise fail(pos, a, "a backward runs whole (B) or split (I then W), not both")
            if a.kind is BW and (BI, a.microbatch, a.chunk) not in seen:
                raise fail(pos, a, "BACKWARD_WEIGHT before its BACKWARD_INPUT")
            neighbour = v - 1 if a.kind is F else v + 1
            if a.kind is not BW and 0 <= neighbour < n_virtual:
                holder, holder_chunk = stage_location(neighbour, pp, placement)
                if holder == rank:  # local hand-over (pp == 1, or the turn of a V)
                    needed = Action(F if a.kind is F else B, a.microbatch, holder_chunk)
                    done = {F} if a.kind is F else INPUT_GRAD_KINDS
                    ok = any((k, a.microbatch, holder_chunk) in seen for k in done)
                else:
                    needed = Action(_INPUT_OF[a.kind], a.microbatch, a.chunk, holder)
                    ok = (needed.kind, needed.microbatch, needed.chunk) in seen
                if not ok:
                    raise fail(pos, a, f"its input is not on hand yet (needs {needed} before it)")
            live += 1 if a.kind is F else -(a.kind in FREEING_KINDS)
            peak = max(peak, live)
        seen.add(key)

    for mb in range(m):
        for chunk in range(vpp):
            v = virtual_stage(rank, chunk, pp, placement)
            owed = [F, B] if (BI, mb, chunk) not in seen else [F, BI, BW]
            if v + 1 < n_virtual and stage_location(v + 1, pp, placement)[0] != rank:
                owed.append(ActionKind.SEND_ACT)
            if v > 0 and stage_location(v - 1, pp, placement)[0] != rank:
                owed.append(ActionKind.SEND_GRAD)
            for kind in owed:
                if (kind, mb, chunk) not in seen:
                    raise ScheduleError(f"rank {rank}, end of list (position {len(actions)}): missing "
                                        f"{kind.name} of micro-batch {mb}, chunk {chunk}")
    return peak


def _peer_problem(a: Action, v: int, rank: int, pp: int, n_virtual: int, placement: str) -> str | None:
    towards_next = a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD)
    neighbour = v + 1 if towards_next else v - 1
    if not 0 <= neighbour < n_virtual:
        return f"virtual stage {v} has no {'next' if towards_next else 'previous'} stage to talk to"
    expected = stage_location(neighbour, pp, placement)[0]
    if expected == rank:
        return f"virtual stage {neighbour} is on this rank: the tensor is passed locally, not communicated"
    if a.peer != expected:
        return f"peer should be rank {expected} (it holds virtual stage {neighbour}), got {a.peer!r}"
    return None


def _payload(a: Action, rank: int, pp: int, placement: str) -> tuple[str, int, int]:
    """What travels: (act | grad, micro-batch, virtual stage that receives it)."""
    v = virtual_stage(rank, a.chunk, pp, placement)
    if a.kind is ActionKind.SEND_ACT:
        return "act", a.microbatch, v + 1
    if a.kind is ActionKind.SEND_GRAD:
        return "grad", a.microbatch, v - 1
    return ("act" if a.kind is ActionKind.RECV_ACT else "grad"), a.microbatch, v


def _match_channels(stages: list[list[Action]], placement: str,
                    verify: bool = True) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair the k-th send with the k-th receive of each channel; (rank, position) -> the partner's."""
    pp = len(stages)
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for rank, actions in enumerate(stages):
        for pos, a in enumerate(actions):
            if a.kind not in COMM_KINDS:
                continue
            assert a.peer is not None, a  # every communication names its peer (`Action`)
            if a.kind in SEND_KINDS:
                sends.setdefault((rank, a.peer), []).append(pos)
            else:
                recvs.setdefault((a.peer, rank), []).append(pos)
    partners: dict[tuple[int, int], tuple[int, int]] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        sent, received = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k, (i, j) in enumerate(zip(sent, received, strict=False)):
            send, recv = stages[src][i], stages[dst][j]
            if verify and _payload(send, src, pp, placement) != _payload(recv, dst, pp, placement):
                raise ScheduleError(f"FIFO mismatch on channel {src}->{dst}: message #{k} is sent as {send} "
                                    f"(rank {src}, position {i}) but received as {recv} "
                                    f"(rank {dst}, position {j})")
            partners[(src, i)], partners[(dst, j)] = (dst, j), (src, i)
        if len(sent) != len(received):
            if len(sent) > len(received):
                extra_rank, extra = src, sent[len(received)]
            else:
                extra_rank, extra = dst, received[len(sent)]
            raise ScheduleError(f"rank {extra_rank}, position {extra} ({stages[extra_rank][extra]}): no "
                                f"matching op on channel {src}->{dst} ({len(sent)} sends, {len(received)} "
                                "receives)")
    return partners


def _steps(actions: list[Action]) -> list[tuple[int, int]]:
    steps: list[tuple[int, int]] = []
    for pos, a in enumerate(actions):
        if a.kind in COMM_KINDS and steps and actions[pos - 1].kind in COMM_KINDS:
            steps[-1] = (steps[-1][0], pos + 1)
        else:
            steps.append((pos, pos + 1))
    return steps


_FORWARD_MARKS = "0123456789"
_BACKWARD_MARKS = "abcdefghijklmnopqrstuvwxyz"
_WEIGHT_MARKS = _BACKWARD_MARKS.upper()


def render_gantt(result: SimResult, width: int = 100) -> str:
    """A text Gantt chart: one row per pp rank, a column per makespan / width time units, then a legend."""
    width = max(width, 1)
    scale = result.makespan / width if result.makespan > 0 else 1.0
    rows = []
    for rank, intervals in enumerate(result.timeline):
        row = ["."] * width
        # Communication first, so compute drawn later wins a shared column.
        for start, end, a in sorted(intervals, key=lambda iv: iv[2].kind in COMPUTE_KINDS):
            if a.kind is F:
                mark = _FORWARD_MARKS[a.microbatch % len(_FORWARD_MARKS)]
            elif a.kind in (B, BI):
                mark = _BACKWARD_MARKS[a.microbatch % len(_BACKWARD_MARKS)]
            elif a.kind is BW:
                mark = _WEIGHT_MARKS[a.microbatch % len(_WEIGHT_MARKS)]
            else:
                mark = "~"
            first = min(int(start / scale + 0.5), width - 1)
            last = max(first + 1, min(int(end / scale + 0.5), width))
            row[first:last] = mark * (last - first)
        rows.append(f"rank {rank:>2} |{''.join(row)}|")
    legend = (f"legend: 0-9 forward of micro-batch (mod 10), a-z backward (or its input-gradient half) of "
              f"micro-batch (mod 26), A-Z weight-gradient half, "
              f"~ communication, . idle; 1 column = {scale:g} time units; makespan {result.makespan:g}, "
              f"bubble {result.bubble_fraction:.1%}")
    return "\n".join([*rows, legend])
