"""A finished step, recorded: its row (the metrics log, the trackers, the service's polls), the events it makes
(a checkpoint written or not, a compile, the recovery it ends, a dropped replica's rejoin) and the gauges.
`StepRecorder` is the one writer of rows for the step loop and the replica drop; it keeps each rank's last
resident peak, which an out-of-memory failure names."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from trainyard.actors.calls import Unrecoverable
from trainyard.actors.journal import Journal
from trainyard.actors.progress import Progress
from trainyard.actors.telemetry import Rows, StepRow, checkpoint_event, compile_event, make_row, set_gauges
from trainyard.parallel.plan import Plan
from trainyard.parallel.runtime.step.step_stats import StepReport

log = logging.getLogger("trainyard.coordinator")


class StepRecorder:
    def __init__(self, job_id: str, plan: Callable[[], Plan], progress: Progress, journal: Journal, rows: Rows):
        """`plan`: the job's plan now (a resize changes it)."""
        self.job_id, self._plan, self.progress, self.journal, self.rows = job_id, plan, progress, journal, rows
        self.rank_peaks: dict[int, int] = {}
        """Each rank's resident high-water mark as its last finished step reported it (an out-of-memory error names
        the rank's)."""

    def record_answers(self, answers: list[list[StepReport]]) -> None:
        """The rows of the steps whose figures one call to every rank returned (each rank returns the same steps,
        `RankDriver.queue_step`), in step order, each timed by its own step's call."""
        cfg = self._plan().config
        by_step: dict[int, list[StepReport]] = {}
        for finished in answers:
            for report in finished:
                by_step.setdefault(report.step, []).append(report)
        for step, results in sorted(by_step.items()):
            row = make_row(step, results, self.progress.timed.pop(step), cfg.global_batch * cfg.model.seq_len,
                           cfg.planned.predicted_step_s if cfg.planned else None)
            self.record(row, results)

    def record(self, row: StepRow, results: list[StepReport] | None = None) -> None:
        """A finished step: its checkpoint event, the recovery it ends, the replicas it gave back (local_sgd,
        diloco: from the ranks' `results`, the steps each replica holds, and the rejoin of a dropped one), its row,
        the gauges."""
        plan, progress = self._plan(), self.progress
        if results is not None:  # by the rank each answer names: after a replica drop, not every rank answers
            self.rank_peaks.update({plan.rank_of(r.stats.pp_rank, r.stats.tp_rank, r.dp_rank): r.peak_rss_bytes
                                    for r in results if r.peak_rss_bytes is not None and r.stats is not None})
        if results is not None and plan.sync.steps_apart and plan.dp > 1:
            stepped = {r.dp_rank for r in results if not r.sat_out}
            back = progress.replicas_stepped(row.step, plan.dp, stepped)
            if back:
                self.journal.add_event({"time": time.time(), "kind": "replica_rejoined", "step": row.step + 1,
                                        "replicas": list(back), "steps_missed": list(back.values())})
            row = replace(row, replica_steps=list(progress.replica_steps))
        for event in (compile_event(row), checkpoint_event(row)):
            if event is not None:
                self.journal.add_event(event)
        if row.checkpoint_blocked_s is not None or row.checkpoint_error is not None:
            self.checkpoint_written(row.step, row.checkpoint_error)
        if (failed_at := progress.recovered()) is not None:
            now = time.time()
            self.journal.add_event({"time": now, "kind": "recovered", "step": row.step + 1,
                                    "recovery_s": now - failed_at, "failure": len(self.journal.causes)})
        self.rows.add(row)
        set_gauges(self.job_id, row, plan.config.steps)

    def checkpoint_written(self, step: int, error: str | None) -> None:
        """The checkpoint scheduled after `step` written, or not (`error`: why): a failed write is an event, and
        `checkpoint.max_write_failures` of them in a row fail the job (before that it trains on, from the checkpoints
        it has, and tries again)."""
        in_a_row = self.progress.checkpoint_written(ok=error is None)
        if error is None:
            return
        limit = self._plan().config.checkpoint.max_write_failures
        self.journal.add_event({"time": time.time(), "kind": "checkpoint_failed", "step": step + 1,
                                "error": error, "in_a_row": in_a_row})
        log.warning("job %s: %s (%d in a row, of checkpoint.max_write_failures=%d)", self.job_id, error, in_a_row,
                    limit)
        if in_a_row >= limit:
            raise Unrecoverable(f"{in_a_row} checkpoints in a row could not be written (checkpoint.max_write_failures="
                                f"{limit}); the last: {error}")
