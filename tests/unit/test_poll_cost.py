"""Following a job costs the same per poll at its end as at its start: the coordinator's report holds only
the new metrics rows and events (a cursor), the journal is appended to, and the service's store writes only
what is new. Counted in rows, events, SQL statements and bytes, not in time (the measured times are in
BENCHMARKS.md, `python -m bench.run --only poll`)."""

from __future__ import annotations

from helpers import tiny_spec
from step_helpers import step_row
from trainyard.actors.controller import Controller
from trainyard.actors.state import JobStatus
from trainyard.actors.storage import JobStorage
from trainyard.actors.telemetry import StepRow
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec
from trainyard.service.following.follow import Cursor, apply_report
from trainyard.service.store import JobRecord, JobStore


def fake_row(step: int) -> StepRow:
    """A step's metrics row as `actors.telemetry.make_row` builds it (every 50th step wrote a checkpoint)."""
    return step_row(step, checkpoint_blocked_s=0.01 if (step + 1) % 50 == 0 else None)


class Follow:
    """A coordinator's controller and the service's store, polled as the manager polls."""

    def __init__(self, tmp_path):
        plan = make_plan(parse_spec(tiny_spec(steps=20_000)))  # the plan's steps only bound the log lines
        storage = JobStorage(checkpoint_root=str(tmp_path / "ckpt"), model_path=str(tmp_path / "model"))
        self.ctl = Controller("job", plan, None, storage, restarted=False)
        self.store = JobStore(tmp_path / "jobs.db")
        self.store.insert(JobRecord(job_id="job", name="t", status=JobStatus.RUNNING, spec={}, steps=20_000))
        self.cursor, self.step = Cursor(step=0), 0
        self.statements = 0
        self.store._db.set_trace_callback(lambda _: setattr(self, "statements", self.statements + 1))

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.ctl.recorder.record(fake_row(self.step))
            self.step += 1

    def poll(self) -> dict:
        """One poll; what it cost: rows and events carried, SQL statements run, rows the store changed."""
        events_from = self.cursor.events if self.cursor.incarnation is not None else None
        report = self.ctl.report(self.cursor.step, events_from)
        statements, changes = self.statements, self.store._db.total_changes
        apply_report(self.store, "job", report, self.cursor)
        return {"rows": len(report["metrics"]), "events": len(report["events"]),
                "statements": self.statements - statements, "changes": self.store._db.total_changes - changes}


LONG = 1_000
"""Steps of the long job (the bench follows one of 20,000; the counts do not depend on the length)."""


def test_a_poll_costs_the_same_at_the_end_of_a_long_job_as_at_step_150(tmp_path):
    follow = Follow(tmp_path)
    follow.poll()  # the first poll of a coordinator reads its whole list of events (once)
    follow.train(100)
    follow.poll()
    follow.train(50)
    early = follow.poll()
    follow.train(LONG - 150 - 50)
    follow.poll()
    journal_before = follow.ctl.journal.bytes_written
    follow.train(50)
    late = follow.poll()
    assert early == late == {"rows": 50, "events": 1, "statements": late["statements"], "changes": late["changes"]}
    assert late["changes"] == 50 + 1 + 1  # the new rows, the new event, the job's row
    # One checkpoint event appended to the journal, of the same size as early on (not the whole history).
    assert follow.ctl.journal.bytes_written - journal_before < 200
    # And the store holds everything, in order.
    assert len(follow.store.metrics("job")) == LONG
    assert [e["step"] for e in follow.store.get("job").events] == list(range(50, LONG + 1, 50))


def test_a_restarted_coordinator_is_read_whole_once(tmp_path):
    follow = Follow(tmp_path)
    follow.poll()
    follow.train(100)
    follow.poll()
    follow.cursor.incarnation = "an earlier one"  # as if Ray restarted the coordinator since the last poll
    assert follow.poll()["events"] == 0  # a list the cursor does not count in: not taken
    assert follow.poll()["events"] == 2  # then all of it, replacing the store's
    assert [e["step"] for e in follow.store.get("job").events] == [50, 100]
