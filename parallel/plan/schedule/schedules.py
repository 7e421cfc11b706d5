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

from collections.abc import Callable
from dataclasses import dataclass

from trainyard.parallel.names import SCHEDULE_KINDS, registry
from trainyard.parallel.plan.schedule.actions import Action, ActionKind, ScheduleError, stage_location, virtual_stage


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


# --- compute orders: (F | B | I | W, microbatch, local chunk), per rank; registered in SCHEDULES ---

Compute = tuple[ActionKind, int, int]
F, B = ActionKind.FORWARD, ActionKind.BACKWARD
BI, BW = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def _gpipe_order(m: int, vpp: int) -> list[Compute]:
    # All forwards chunk by chunk, then all backwards in reverse chunk order (with vpp > 1 this is the
    # breadth-first "looped" schedule: the same bubble as interleaved, but every activation is held at once).
    forwards = [(F, mb, c) for c in range(vpp) for mb in range(m)]
    backwards = [(B, mb, c) for c in reversed(range(vpp)) for mb in range(m)]
    return forwards + backwards


def _one_f_one_b_order(pp: int, m: int, rank: int) -> list[Compute]:
    warmup = min(pp - rank - 1, m)
    order: list[Compute] = [(F, mb, 0) for mb in range(warmup)]
    for i in range(m - warmup):
        order += [(F, warmup + i, 0), (B, i, 0)]
    return order + [(B, mb, 0) for mb in range(m - warmup, m)]


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


# --- communication placement ---

# Integer reference costs for placement (forward 1, backward 2): every time is exact, so "both ranks are
# between computes at the same instant" can be tested with ==.
_PLACE_COST = {F: 1, B: 2, BI: 1, BW: 1}
_MESSAGE_KINDS = {F: (ActionKind.SEND_ACT, ActionKind.RECV_ACT),
                  B: (ActionKind.SEND_GRAD, ActionKind.RECV_GRAD),
                  BI: (ActionKind.SEND_GRAD, ActionKind.RECV_GRAD)}


def _refuse_1f1b(pp: int, m: int, vpp: int) -> str | None:
    if vpp != 1:
        return f"1f1b needs vpp=1 (got vpp={vpp}); use interleaved-1f1b for virtual stages"
    return None


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


def _refuse_zb_h1(pp: int, m: int, vpp: int) -> str | None:
    if vpp != 1:
        return f"zb-h1 needs vpp=1 (got vpp={vpp}); zbv runs two chunks per rank"
    return None


def _refuse_zbv(pp: int, m: int, vpp: int) -> str | None:
    if vpp != 2:
        return f"zbv needs vpp=2 (got vpp={vpp}): it places exactly two chunks per rank, in a V"
    return None


@dataclass(frozen=True)
class Schedule:
    """One schedule kind: each rank's compute order, and why it cannot serve a (pp, microbatches, vpp)."""

    name: str
    order: Callable[[int, int, int, int], list[Compute]]
    """(pp, microbatches, vpp, rank) -> that rank's forwards and backwards in order."""
    refuse: Callable[[int, int, int], str | None] = lambda pp, m, vpp: None
    """(pp, microbatches, vpp) -> the reason it cannot build them, or None."""
    placement: str = "interleaved"
    """Which virtual stages each rank's chunks are (`virtual_stage`)."""
    splits_backward: bool = False
    """Its backwards are input (I) and weight (W) halves run apart (`parallel.runtime.split_backward`)."""


SCHEDULES: dict[str, Schedule] = registry(SCHEDULE_KINDS, {s.name: s for s in (
    Schedule("gpipe", lambda pp, m, vpp, rank: _gpipe_order(m, vpp)),
    Schedule("1f1b", lambda pp, m, vpp, rank: _one_f_one_b_order(pp, m, rank), _refuse_1f1b),
    Schedule("interleaved-1f1b", _interleaved_order, _refuse_interleaved),
    Schedule("zb-h1", lambda pp, m, vpp, rank: _zb_h1_order(pp, m, rank), _refuse_zb_h1, splits_backward=True),
    Schedule("zbv", lambda pp, m, vpp, rank: _zbv_order(pp, m, rank), _refuse_zbv, placement="v", splits_backward=True),
)}, "parallel.plan.schedule.schedules.SCHEDULES")
"""The pipeline schedule kinds `parallel.schedule` may name (`parallel.names.SCHEDULE_KINDS`, in this order); a new
one is a new entry and its name there."""


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
