"""Pipeline schedules: the ordered actions each pipeline rank runs in one training step.

`build_schedule(kind, pp, microbatches, vpp)` returns one list of `Action`s per pipeline rank, from the compute order of
the kind's entry in `SCHEDULES`. Workers run their list literally (`parallel.runtime.pipeline`);
`parallel.plan.schedule.schedule_sim` checks a list and times it. This module owns the compute order of each schedule
kind and where the point-to-point messages go; the action vocabulary, its labels and the placement of virtual stages on
the ranks (interleaved, or a V for zbv) are `parallel.plan.schedule.actions`'s. Pure: no torch.

Split backward (zero-bubble kinds): a chunk's backward may run as I (the gradient of its input, what the
previous stage waits for) then W (its weights' gradients, which can wait); B is both at once. torch's
DualPipeV is not offered: its gain is running one micro-batch's forward beside another's backward to hide
communication (torch's OVERLAP_F_B action), which an executor running one action at a time cannot do.

Communication semantics the lists are built for: a maximal run of consecutive communication actions is
posted as one `batch_isend_irecv` and waited on as a whole; a rank blocks there until the peer has posted the
matching op of every message in the run. Messages between two ranks match strictly first-in-first-out per
direction (no tags), so both ends list a channel's messages in the same order. When the neighbouring virtual
stage is on the same rank (with pp == 1, or at the turn of a V) there is no communication action: the tensor is
passed locally.
"""

from __future__ import annotations

from trainyard.parallel.names import SCHEDULE_KINDS, registry
from trainyard.parallel.plan.schedule.actions import Action, ActionKind, ScheduleError, stage_location, virtual_stage
from trainyard.parallel.plan.schedule.kind import BI, BW, B, Compute, F, Schedule
from trainyard.parallel.plan.schedule.kinds import gpipe, interleaved, one_f_one_b, two_bw, zb_h1, zbv


def check_schedule_args(kind: str, pp: int, microbatches: int, vpp: int) -> None:
    """Raise ScheduleError if `build_schedule` cannot build this combination."""
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {kind!r}; expected one of {', '.join(SCHEDULE_KINDS)}")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{kind} needs {name} >= 1 (got {name}={value!r})")
    why = SCHEDULES[kind].refuse(pp, microbatches, vpp)
    if why is not None:
        raise ScheduleError(why)


def build_schedule(kind: str, pp: int, microbatches: int, vpp: int = 1) -> list[list[Action]]:
    """One ordered action list per pipeline rank (index = pp rank)."""
    check_schedule_args(kind, pp, microbatches, vpp)
    schedule = SCHEDULES[kind]
    return place_comm([schedule.order(pp, microbatches, vpp, rank) for rank in range(pp)], pp, vpp,
                      schedule.placement)


def placement_of(kind: str) -> str:
    """How a schedule kind places the virtual stages on the ranks: "interleaved" or "v"."""
    return SCHEDULES[kind].placement


# --- communication placement ---

# Integer reference costs for placement (forward 1, backward 2): every time is exact, so "both ranks are
# between computes at the same instant" can be tested with ==.
_PLACE_COST = {F: 1, B: 2, BI: 1, BW: 1}
_MESSAGE_KINDS = {F: (ActionKind.SEND_ACT, ActionKind.RECV_ACT),
                  B: (ActionKind.SEND_GRAD, ActionKind.RECV_GRAD),
                  BI: (ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)}


SCHEDULES: dict[str, Schedule] = registry(SCHEDULE_KINDS, {s.name: s for s in (
    gpipe.SCHEDULE, one_f_one_b.SCHEDULE, interleaved.SCHEDULE, zb_h1.SCHEDULE, zbv.SCHEDULE, two_bw.SCHEDULE,
)}, "parallel.plan.schedule.schedules.SCHEDULES")
"""The pipeline schedule kinds `parallel.schedule` may name (`parallel.names.SCHEDULE_KINDS`, in this order), one
module each in `parallel.plan.schedule.kinds`: a new one is its module, its line here and its name there."""


def place_comm(orders: list[list[Compute]], pp: int, vpp: int, placement: str = "interleaved") -> list[list[Action]]:
    """Insert the sends and receives into the compute orders, so that the lists cannot deadlock.

    Runs the orders on an event clock with the reference costs. A message is exchanged at the first instant
    its sender (which has produced it) and its receiver are both between two computes; both put the messages
    exchanged at that instant into their communication run in one global order, so every channel's sends and
    receives line up FIFO. A rank whose next compute lacks an input waits; one whose next compute is ready
    starts it and sends later. This execution is itself a run under the blocking semantics that completes, and
    whether lists deadlock does not depend on timing, so the lists are deadlock-free for any costs.
    """
    out: list[list[Action]] = [[] for _ in range(pp)]
    pos = [0] * pp
    running: list[tuple[int, Compute] | None] = [None] * pp  # (end time, compute) in progress on each rank
    on_hand: list[set[Compute]] = [set() for _ in range(pp)]  # computes done and inputs received
    pending: list[tuple[int, int, Action, Action]] = []  # (src, dst, send, recv), in production order
    now = 0
    while True:
        for rank, job in enumerate(running):  # computes ending now produce their outputs
            if job is None or job[0] != now:
                continue
            running[rank] = None
            on_hand[rank].add(job[1])
            message = _message_from(job[1], rank, pp, vpp, placement)
            if message is None:
                continue
            dst, send, recv = message
            if dst == rank:  # the neighbouring chunk is on this rank: handed over locally
                on_hand[rank].add((recv.kind, recv.microbatch, recv.chunk))
            else:
                pending.append((rank, dst, send, recv))

        idle = {rank for rank in range(pp) if running[rank] is None}
        for posted in [m for m in pending if m[0] in idle and m[1] in idle]:
            src, dst, send, recv = posted
            out[src].append(send)
            out[dst].append(recv)
            on_hand[dst].add((recv.kind, recv.microbatch, recv.chunk))
            pending.remove(posted)

        for rank in sorted(idle):
            if pos[rank] < len(orders[rank]) and _inputs_ready(orders[rank][pos[rank]], rank, pp, vpp,
                                                               on_hand[rank], placement):
                kind, mb, chunk = orders[rank][pos[rank]]
                out[rank].append(Action(kind, mb, chunk))
                running[rank] = (now + _PLACE_COST[kind], orders[rank][pos[rank]])
                pos[rank] += 1

        ends = [job[0] for job in running if job is not None]
        if not ends:
            left = {rank: orders[rank][pos[rank]] for rank in range(pp) if pos[rank] < len(orders[rank])}
            if left or pending:  # an order whose dependencies form a cycle: a bug in this module
                raise ScheduleError(f"compute order cannot make progress; next computes per rank: {left}")
            return out
        now = min(ends)


def _message_from(compute: Compute, rank: int, pp: int, vpp: int,
                  placement: str) -> tuple[int, Action, Action] | None:
    """(destination rank, send, receive) of what this compute produces for its neighbour, if it has one."""
    kind, mb, chunk = compute
    target = virtual_stage(rank, chunk, pp, placement) + (1 if kind is F else -1)
    if kind is BW or not 0 <= target < pp * vpp:
        return None
    dst, dst_chunk = stage_location(target, pp, placement)
    send, recv = _MESSAGE_KINDS[kind]
    return dst, Action(send, mb, chunk, dst), Action(recv, mb, dst_chunk, rank)


def _inputs_ready(compute: Compute, rank: int, pp: int, vpp: int, available: set[Compute],
                  placement: str) -> bool:
    kind, mb, chunk = compute
    v = virtual_stage(rank, chunk, pp, placement)
    if kind is BW:
        return (BI, mb, chunk) in available
    if kind is F:
        return v == 0 or (ActionKind.RECV_ACT, mb, chunk) in available
    last = v == pp * vpp - 1
    return (F, mb, chunk) in available and (last or (ActionKind.RECV_GRAD, mb, chunk) in available)
