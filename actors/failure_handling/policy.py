"""The failure policy's protocol: what the state machine asks about a failure (`state.failure_decision`), and the
decision it gets. The policies themselves are named in `registry`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class FailureAction(StrEnum):
    RECOVER = "recover"
    """Recovered from, counted against the job's failure budget."""
    RIDE = "ride"
    """Ridden (an elastic job lost a node): recovered from, not counted."""
    RAISE = "raise"
    """The job fails with every cause."""


@dataclass(frozen=True)
class FailureDecision:
    action: FailureAction
    reason: str


class FailurePolicy(Protocol):
    """Decides what a failure leads to. A failure while recovering or resizing is asked about like any other."""

    def decide(self, counted_before: int, *, node_lost: bool, stopping: bool,
               out_of_memory: bool = False) -> FailureDecision:
        """`counted_before`: the failures counted so far; `node_lost`: a rank that died was on a node Ray lost;
        `stopping`: the job was asked to stop; `out_of_memory`: a blamed rank ran out of memory."""
        ...
