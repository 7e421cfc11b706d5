"""What the job was asked from outside that the actions read: a stop (`Requests`, set by the controller as the
service asks) and the fault drills still to run (`Drills`, added by the coordinator's `inject`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Requests:
    stop: bool = False
    """Stop at the next step boundary, with a final checkpoint."""
    suspend: bool = False
    """With `stop`: the service is going down; the final checkpoint is what the job goes on from later (no model)."""


@dataclass(frozen=True)
class Drill:
    kind: str
    rank: int
    at_step: int
    factor: float = 1.0
    """slow_rank: how many times as long the rank's steps take from `at_step` on."""


class Drills:
    """Fault drills still to run: kind, rank, at_step. Worker drills go with the rank's step call;
    `kill_coordinator` exits this process; `kill_worker_in_recovery` kills the rank while the ranks take the
    job's state in the next recovery at or after `at_step` (a failure during a recovery); `kill_worker_in_export`
    kills it as the model is exported at the job's end."""

    COORDINATOR_SIDE = ("kill_coordinator", "kill_worker_in_recovery", "kill_worker_in_export")

    def __init__(self) -> None:
        self.pending: list[Drill] = []

    def add(self, kind: str, rank: int, at_step: int, factor: float = 1.0) -> None:
        self.pending.append(Drill(kind, rank, at_step, factor))

    def due_on_ranks(self, step: int) -> dict[int, Drill]:
        """The workers' drills due at `step`, by rank; each is handed over once (a slow_rank drill then stays on
        with its rank)."""
        due = [d for d in self.pending if d.at_step <= step and d.kind not in self.COORDINATOR_SIDE]
        self.pending = [d for d in self.pending if d not in due]
        return {d.rank: d for d in due}

    def kills_coordinator(self, step: int) -> bool:
        """A kill_coordinator drill is due as the coordinator waits for `step` (its restart has no drills)."""
        return any(d.kind == "kill_coordinator" and d.at_step <= step for d in self.pending)

    def in_recovery(self, step: int) -> list[int]:
        """The ranks to kill in the recovery under way (which restores `step`); each drill runs once."""
        due = [d for d in self.pending if d.kind == "kill_worker_in_recovery" and d.at_step <= step]
        self.pending = [d for d in self.pending if d not in due]
        return [d.rank for d in due]

    def in_export(self) -> list[int]:
        """The ranks to kill as the model is exported; each drill runs once."""
        due = [d for d in self.pending if d.kind == "kill_worker_in_export"]
        self.pending = [d for d in self.pending if d not in due]
        return [d.rank for d in due]
