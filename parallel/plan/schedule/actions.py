"""The pipeline's action vocabulary: what one step of a rank's list is (`Action`: kind, micro-batch, local chunk, peer),
its text form (`format_actions` / `parse_actions`, so a hand-written table is a valid input), and where a virtual stage
lives (`virtual_stage`, `stage_location`). The schedule builders (`parallel.plan.schedule.schedules`), the simulator
(`parallel.plan.schedule.schedule_sim`) and the executor (`parallel.runtime.pipeline`) all speak it. Pure: no torch.

Layout (`placement`, set by the schedule kind): rank r holds local chunks 0..vpp-1. Interleaved (every kind
but zbv): they are virtual stages r, r+pp, r+2pp, ... (Megatron's interleaving), so virtual stage v lives on rank
v % pp as local chunk v // pp. V (zbv, as torch's `ScheduleZBVZeroBubble`): an even chunk c is virtual stage
c*pp + r and an odd one (c+1)*pp - 1 - r, so the model runs down the ranks and back up: rank r holds stages r
and 2pp-1-r, rank 0 both the first and the last. With pp == 1 both placements are the same.

Labels (`str(action)`): F3.1 / B3.1 run forward / backward of micro-batch 3 on local chunk 1 (I3.1 / W3.1:
its input-gradient / weight-gradient half); sA3.1>2 sends that chunk's output activation to rank 2; rA3.1<0
receives its input activation from rank 0; sG3.1>0 sends the gradient of its input to rank 0; rG3.1<2 receives
the gradient of its output from rank 2.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "sA"
    RECV_ACT = "rA"
    SEND_GRAD = "sG"
    RECV_GRAD = "rG"

    # Members are singletons compared by identity: identity's hash, in C, instead of Enum's hash of the name in
    # Python (the simulator looks kinds up in sets millions of times when the planner searches a large cluster).
    __hash__ = object.__hash__


COMM_KINDS = frozenset({ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD})
SEND_KINDS = frozenset({ActionKind.SEND_ACT, ActionKind.SEND_GRAD})
INPUT_GRAD_KINDS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT})
"""The computes that produce a chunk's input gradient (what SEND_GRAD sends)."""
FREEING_KINDS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT})
COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                           ActionKind.BACKWARD_WEIGHT})
"""The actions that compute (the rest send and receive)."""
"""The computes after which a chunk's activation of a micro-batch is no longer held."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's list. `chunk` is the LOCAL chunk index; `peer` the pp rank at the other end.

    SEND_ACT(mb, c): send the output activation of chunk c to peer. RECV_ACT(mb, c): receive chunk c's input
    activation from peer. SEND_GRAD(mb, c): send the gradient wrt chunk c's input to peer. RECV_GRAD(mb, c):
    receive the gradient wrt chunk c's output from peer.
    """

    kind: ActionKind
    microbatch: int
    chunk: int
    peer: int | None = None

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        label = f"{self.kind.value}{self.microbatch}.{self.chunk}"
        if self.kind in SEND_KINDS:
            return f"{label}>{self.peer}"
        if self.kind in COMM_KINDS:
            return f"{label}<{self.peer}"
        return label


class ScheduleError(ValueError):
    """A schedule that cannot be built, or an action list that is not a valid one; the message says why."""


def format_actions(actions: list[Action]) -> str:
    """One rank's list on one line, each communication run in brackets: `F0.0 [sA0.0>1 rG0.0<1] B0.0`."""
    parts: list[str] = []
    run: list[str] = []
    for action in actions:
        if action.is_comm:
            run.append(str(action))
            continue
        if run:
            parts.append(f"[{' '.join(run)}]")
            run = []
        parts.append(str(action))
    if run:
        parts.append(f"[{' '.join(run)}]")
    return " ".join(parts)


_LABEL = re.compile(r"(F|B|I|W|sA|rA|sG|rG)(\d+)\.(\d+)(?:[<>](\d+))?")


def parse_actions(text: str) -> list[Action]:
    """The inverse of `format_actions`, for hand-written lists; brackets are optional (runs are adjacency)."""
    actions = []
    for token in text.replace("[", " ").replace("]", " ").split():
        match = _LABEL.fullmatch(token)
        if match is None:
            raise ScheduleError(f"cannot read action {token!r} (expected e.g. F3.1, B3.1, sA3.1>2, rG3.1<2)")
        kind, mb, chunk, peer = match.groups()
        actions.append(Action(ActionKind(kind), int(mb), int(chunk), None if peer is None else int(peer)))
    return actions


def virtual_stage(rank: int, chunk: int, pp: int, placement: str = "interleaved") -> int:
    """The virtual stage a rank's local chunk is (see the module docstring for the two placements)."""
    if placement == "v" and chunk % 2:
        return (chunk + 1) * pp - 1 - rank
    return chunk * pp + rank


def stage_location(v: int, pp: int, placement: str = "interleaved") -> tuple[int, int]:
    """(pp rank, local chunk) of virtual stage v."""
    chunk, offset = divmod(v, pp)
    if placement == "v" and chunk % 2:
        return pp - 1 - offset, chunk
    return offset, chunk
