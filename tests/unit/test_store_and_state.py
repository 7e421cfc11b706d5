"""The SQLite job store (the coordinator's transitions: tests/unit/test_coordinator_states.py)."""


from trainyard.actors.state import JobStatus
from trainyard.service.following.follow import Cursor, apply_report
from trainyard.service.store import JobRecord, JobStore


def test_store_keeps_jobs_and_metrics_across_reopen(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    store.insert(JobRecord(job_id="j1", name="a", status=JobStatus.PENDING, spec={"steps": 2}, steps=2))
    store.add_metrics("j1", [{"step": 0, "loss": 5.0}, {"step": 1, "loss": 4.0}])
    store.update("j1", status=JobStatus.SUCCEEDED, step=2)
    store.close()
    reopened = JobStore(tmp_path / "jobs.db")
    job = reopened.get("j1")
    assert job.status is JobStatus.SUCCEEDED and job.step == 2 and job.spec == {"steps": 2}
    assert [r["loss"] for r in reopened.metrics("j1", since=1)] == [4.0]
    reopened.delete("j1")
    assert reopened.get("j1") is None and reopened.metrics("j1") == []


def test_a_late_report_never_revives_or_refails_an_ended_job(tmp_path):
    # The follower thread may apply a poll answered just before a stop, or see the stopped job's
    # coordinator gone: neither may overwrite the STOPPED the stop wrote.
    store = JobStore(tmp_path / "jobs.db")
    store.insert(JobRecord(job_id="j1", name="a", status=JobStatus.RUNNING, spec={}, steps=9))
    store.update("j1", status=JobStatus.STOPPED, step=3)
    store.update("j1", status=JobStatus.RUNNING, step=2)
    store.update("j1", status=JobStatus.FAILED, error="the job's coordinator died")
    job = store.get("j1")
    assert job.status is JobStatus.STOPPED and job.step == 3 and job.error is None
    store.update("j1", actors=["a"])  # fields other than status and error still change
    assert store.get("j1").actors == ["a"]


def test_store_uses_write_ahead_logging(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_job_stopped_during_a_recovery_from_a_checkpoint_keeps_no_rows_past_its_step(tmp_path):
    # Steps 0-14 ran, a rank died in step 15, the recovery went back to the checkpoint of step 10, and the stop
    # landed before step 10 ran again: the job, its final checkpoint and its model are at step 10.
    store = JobStore(tmp_path / "jobs.db")
    store.insert(JobRecord(job_id="j1", name="a", status=JobStatus.RUNNING, spec={}, steps=100))
    store.add_metrics("j1", [{"step": s, "loss": 5.0 - s / 10} for s in range(15)])
    report = {"metrics": [], "events": [], "events_from": 0, "incarnation": None, "status": "STOPPED", "step": 10,
              "error": None, "actors": [], "ranks": []}
    apply_report(store, "j1", report, Cursor(step=15))
    assert [r["step"] for r in store.metrics("j1")] == list(range(10)) and store.get("j1").step == 10
