"""Where a job's steps stand, between the coordinator's states: the step the ranks start from, the step being
waited for and the one queued behind it, the replicas sitting out (local_sgd, diloco) and the failure a
recovery has yet to close. The step loop (`actions.training`) and the recovery (`actions.recovery`,
`actions.replica_drop`) move it through the named transitions below, so the controller's own fields change only
in `actors.controller`, and every change to these is one of a few verbs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Progress:
    start_step: int = 0
    """The step the ranks' state is before: where the step loop starts, and what a recovery restores."""
    inflight: tuple[int, list] = (-1, [])
    """The step being waited for and its calls (a replica dropped after a failure lets the others finish it)."""
    upcoming: list = field(default_factory=list)
    """The calls of the step queued behind it (at most one step runs ahead)."""
    step_started: float = field(default_factory=time.time)
    """When the step being waited for became the one waited for (the last step's results came back)."""
    dropped: dict[int, int] = field(default_factory=dict)
    """local_sgd, diloco: replicas dropped after a failure -> the step whose sync they rejoin at."""
    replica_steps: list[int] = field(default_factory=list)
    """local_sgd, diloco: the steps each replica's state holds (the rows carry them: `replica_steps`)."""
    failed_at: float | None = None
    """When the failure a recovery is closing happened; None when no recovery is open."""
    checkpoint_failures: int = 0
    """Scheduled checkpoints in a row that could not be written."""
    timed: dict[int, float] = field(default_factory=dict)
    """The wall time of each step whose call came back but whose figures have not yet (they come one step late:
    `actions.training`), for its row."""

    def waiting_for(self, step: int, calls: list, upcoming: list) -> None:
        """The step loop now waits for `step`'s `calls`, with the next step's `upcoming` queued behind them."""
        self.inflight, self.upcoming = (step, calls), upcoming

    def step_timed(self, step: int, seconds: float) -> None:
        """`step`'s call came back `seconds` after the previous step's: its row's time, once its figures come."""
        self.timed[step] = seconds

    def step_began(self) -> None:
        self.step_started = time.time()

    def stopped_at(self, steps_done: int) -> None:
        """The step loop left at a boundary after `steps_done` steps."""
        self.start_step = steps_done

    def restarted_at(self, step: int) -> None:
        """The job starts again from the state after `step` steps (a damaged resume point moved it back)."""
        self.start_step = step

    def resumed_at(self, step: int, failed_at: float, dropped: dict[int, int] | None = None) -> None:
        """After a failure at `failed_at`, the ranks hold the state after `step` steps; `dropped`: the replicas
        that sit out until their rejoin step (none: every replica steps, and their step counts start anew)."""
        self.start_step, self.failed_at = step, failed_at
        self.timed = {}  # the steps timed and never read are run again
        self.dropped = dict(dropped or {})
        if not dropped:
            self.replica_steps = []

    def checkpoint_written(self, ok: bool) -> int:
        """A scheduled checkpoint was written (`ok`) or could not be: the failures in a row now."""
        self.checkpoint_failures = 0 if ok else self.checkpoint_failures + 1
        return self.checkpoint_failures

    def recovered(self) -> float | None:
        """A step finished: the open failure's time (its recovery closes here), or None."""
        failed_at, self.failed_at = self.failed_at, None
        return failed_at

    def replicas_stepped(self, step: int, dp: int, stepped: set[int]) -> dict[int, int]:
        """local_sgd, diloco: `step` finished with the replicas `stepped` taking part. Returns the dropped
        replicas whose rejoin was this step's sync, now back, each with the steps it missed; keeps the steps
        each replica holds."""
        if len(self.replica_steps) != dp:
            self.replica_steps = [step] * dp
        back = {d: step + 1 - self.replica_steps[d] for d, at in sorted(self.dropped.items()) if at == step}
        self.dropped = {d: at for d, at in self.dropped.items() if at != step}
        for d in stepped:
            self.replica_steps[d] = step + 1
        return back

    def take_dropped(self, dp: int) -> tuple[int, ...] | None:
        """At the job's end: the live replicas of `dp` if some sit out (they sync, the others take their
        state), None when every replica steps; no replica sits out afterwards."""
        live = tuple(d for d in range(dp) if d not in self.dropped) if self.dropped else None
        self.dropped = {}
        return live
