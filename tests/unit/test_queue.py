"""The queue: admission order, gang fit, what a waiting job waits for, and the store's race-safe writes."""

from __future__ import annotations

import sqlite3

import pytest
from trainyard.actors.state import JobStatus
from trainyard.cli.main import _attach_values
from trainyard.parallel.config import RuleError
from trainyard.parallel.plan import Gang
from trainyard.service.admission import queue
from trainyard.service.errors import JobConflict
from trainyard.service.state_dir import new_token
from trainyard.service.store import JobRecord, JobStore
from trainyard.service.tenancy.quota import NO_QUOTA, Quota, check, usage


def add(store: JobStore, job_id: str, priority: int = 0, cpus: float = 1.0, count: int = 1,
        owner: str = "admin") -> None:
    needs = {"bundle": {"CPU": cpus}, "count": count}
    store.insert(JobRecord(job_id=job_id, name=job_id, status=JobStatus.PENDING, spec={}, steps=1,
                           priority=priority, needs=needs, owner=owner))


@pytest.fixture()
def store(tmp_path) -> JobStore:
    return JobStore(tmp_path / "jobs.db")


def test_queue_orders_by_priority_then_submission(store):
    for job_id, priority in (("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1)):
        add(store, job_id, priority)
    assert [j.job_id for j in store.queue()] == ["b", "d", "a", "c", "e"]


def test_the_head_is_admitted_only_when_its_whole_gang_fits_one_bundle_per_node(store):
    add(store, "big", cpus=2, count=3)
    waiting = store.queue()
    assert queue.next_to_admit(waiting, [{"CPU": 5.0}]) is None  # room for 2 bundles, not 3
    assert queue.next_to_admit(waiting, [{"CPU": 3.0}, {"CPU": 3.0}]) is None  # 6 CPUs, but one bundle per node
    assert queue.next_to_admit(waiting, [{"CPU": 4.0}, {"CPU": 3.0}]).job_id == "big"


def test_nothing_behind_a_head_that_does_not_fit_is_admitted(store):
    add(store, "big", priority=1, cpus=8)
    add(store, "small", cpus=1)
    assert queue.next_to_admit(store.queue(), [{"CPU": 4.0}]) is None


def test_a_waiting_job_says_what_it_waits_for(store):
    add(store, "big", cpus=2, count=3)
    add(store, "next")
    waiting = store.queue()
    free = [{"CPU": 3.0, "GPU": 0.0}]
    head = queue.waiting_for(1, waiting[0], free)
    assert head["needed"] == {"CPU": 6.0, "GPU": 0.0} and head["free"] == {"CPU": 3.0, "GPU": 0.0}
    assert "3 bundle(s) of {2 CPU} at once" in head["reason"] and "hold 1 now" in head["reason"]
    assert queue.waiting_for(2, waiting[1], free)["reason"].startswith("behind 1 earlier job(s)")


def test_gang_counts_whole_bundles_per_node():
    gang = Gang(bundle={"CPU": 1.0, "GPU": 1.0}, count=4)
    assert gang.placeable([{"CPU": 8.0, "GPU": 2.0}, {"CPU": 1.5, "GPU": 4.0}]) == 3
    assert gang.needed() == {"CPU": 4.0, "GPU": 4.0}


def test_a_claimed_job_leaves_the_queue_and_cannot_be_claimed_twice(store):
    add(store, "a")
    assert store.claim("a") and not store.claim("a")
    assert store.queue() == [] and store.get("a").admitted_at is not None
    store.requeue("a", {"time": 1.0, "kind": "interrupted"})
    assert [j.job_id for j in store.queue()] == ["a"] and store.get("a").events[-1]["kind"] == "interrupted"


def test_a_stopped_or_deleted_job_cannot_be_claimed(store):
    add(store, "a")
    store.update("a", status=JobStatus.STOPPED)
    assert not store.claim("a")
    assert store.delete("a") and not store.claim("a")


def test_only_ended_jobs_are_deleted(store):
    add(store, "a")
    assert not store.delete("a") and store.get("a") is not None
    store.update("a", status=JobStatus.FAILED, error="x")
    assert store.get("a").ended_at is not None
    assert store.delete("a") and not store.delete("a")


def test_metrics_of_a_job_deleted_meanwhile_are_dropped_not_an_error(store):
    # The follower may hold a report of a job a client deletes before the report is written.
    add(store, "a")
    store.update("a", status=JobStatus.STOPPED)
    store.delete("a")
    store.add_metrics("a", [{"step": 0, "loss": 1.0}])
    assert store.metrics("a") == []


def test_a_store_written_by_an_older_service_gains_the_new_columns(tmp_path):
    db = sqlite3.connect(tmp_path / "jobs.db")
    db.executescript("""CREATE TABLE jobs (job_id TEXT PRIMARY KEY, name TEXT NOT NULL, status TEXT NOT NULL,
        spec TEXT NOT NULL, steps INTEGER NOT NULL, step INTEGER NOT NULL DEFAULT 0, error TEXT,
        actors TEXT NOT NULL DEFAULT '[]', created_at REAL NOT NULL, updated_at REAL NOT NULL);
        INSERT INTO jobs VALUES ('old', 'x', 'SUCCEEDED', '{}', 3, 3, NULL, '[]', 1.0, 2.0);""")
    db.commit()
    db.close()
    job = JobStore(tmp_path / "jobs.db").get("old")
    assert job.status is JobStatus.SUCCEEDED and job.priority == 0 and job.ranks == [] and job.admitted_at is None
    assert job.owner == "admin"  # a job from before users is the admin's


def test_service_tokens_never_start_with_a_dash(monkeypatch):
    drawn = iter(["-starts-with-dash", "-again", "fine-token"])
    monkeypatch.setattr("trainyard.service.state_dir.secrets.token_urlsafe", lambda n: next(drawn))
    assert new_token() == "fine-token"


def test_cli_takes_a_token_that_starts_with_a_dash():
    assert _attach_values(["--token", "-abc", "list"], ("--token",)) == ["--token=-abc", "list"]
    assert _attach_values(["--token=x", "list", "--token"], ("--token",)) == ["--token=x", "list", "--token"]


def test_the_progress_bar_shows_the_queue_position_and_the_reason():
    from trainyard.cli.jobs import _waiting_text

    job = {"queue_position": 3, "waiting_for": {"reason": "behind 2 earlier job(s) in the queue"}}
    assert _waiting_text(job) == "queued #3: behind 2 earlier job(s) in the queue"
    assert _waiting_text({"queue_position": None, "waiting_for": None}) == "starting"


def test_a_job_waiting_for_its_layout_does_not_hold_the_queue():
    from trainyard.service.admission.queue import next_to_admit, waiting_for

    unplanned = JobRecord(job_id="auto", name="a", status=JobStatus.PENDING, spec={}, steps=1, needs={})
    planned = JobRecord(job_id="fixed", name="f", status=JobStatus.PENDING, spec={}, steps=1,
                        needs={"bundle": {"CPU": 1.0}, "count": 2})
    assert next_to_admit([unplanned, planned], [{"CPU": 4.0}]) is planned
    assert next_to_admit([unplanned], [{"CPU": 4.0}]) is None
    assert "measured costs" in waiting_for(1, unplanned, [{"CPU": 4.0}])["reason"]


def test_at_equal_priority_users_are_admitted_in_turn_not_first_come(store):
    for job_id, owner in (("a1", "alice"), ("a2", "alice"), ("a3", "alice"), ("b1", "bob"), ("c1", "carol"),
                          ("b2", "bob")):
        add(store, job_id, owner=owner)
    add(store, "urgent", priority=1, owner="alice")
    order = queue.fair_order(store.queue(), running={})
    assert [j.job_id for j in order] == ["urgent", "a1", "b1", "c1", "a2", "b2", "a3"]
    # The jobs a user runs count as turns taken: alice runs two, so bob's and carol's come before her next.
    order = queue.fair_order(store.queue(), running={"alice": 2})
    assert [j.job_id for j in order] == ["urgent", "b1", "c1", "b2", "a1", "a2", "a3"]


def test_a_quota_refuses_a_job_bigger_than_all_of_it_and_holds_one_over_what_is_left():
    q = Quota(cpus=4, gpus=2)
    assert q.never_fits({"CPU": 4.0, "GPU": 2.0}) is None
    assert "needs 6 cpus at once, more than the user's quota of 4 cpus" in q.never_fits({"CPU": 6.0, "GPU": 0.0})
    assert "quota of 2 gpus" in q.never_fits({"CPU": 1.0, "GPU": 3.0})
    assert q.over({"CPU": 3.0, "GPU": 0.0}, {"CPU": 1.0, "GPU": 2.0}) is None
    assert "hold 3 of their 4 cpus and this job needs 2 more" in q.over({"CPU": 3.0}, {"CPU": 2.0, "GPU": 0.0})
    assert NO_QUOTA.never_fits({"CPU": 1e9, "GPU": 1e9}) is None and NO_QUOTA.over({"CPU": 1e9}, {"CPU": 1.0}) is None
    live = [("a1", "a", {"bundle": {"CPU": 2.0}, "count": 1}), ("b1", "b", {"bundle": {"CPU": 1.0, "GPU": 1.0},
            "count": 1}), ("a2", "a", {"bundle": {"CPU": 0.5, "GPU": 1.0}, "count": 2})]
    assert usage(live) == {"a": {"CPU": 3.0, "GPU": 2.0}, "b": {"CPU": 1.0, "GPU": 1.0}}
    assert usage(live, leave_out="a2")["a"] == {"CPU": 2.0, "GPU": 0.0}
    with pytest.raises(RuleError, match="more than the user's quota of 4 cpus") as info:
        check(q, {"CPU": 5.0}, "dp")
    assert info.value.field == "dp"
    with pytest.raises(JobConflict, match="hold 3 of their 4 cpus"):
        check(q, {"CPU": 2.0}, "dp", held={"CPU": 3.0})
    check(q, {"CPU": 2.0}, "resources")  # at submit only all of the quota counts: the job waits for the rest


def test_a_job_its_owners_quota_holds_waits_without_holding_the_queue(store):
    add(store, "a2", cpus=2, owner="alice")
    add(store, "b1", cpus=2, owner="bob")
    quotas = {"alice": Quota(cpus=2)}.get
    held = {"alice": {"CPU": 2.0, "GPU": 0.0}}  # alice's first job runs
    waiting = store.queue()
    assert queue.next_to_admit(waiting, [{"CPU": 8.0}], held, lambda u: quotas(u) or NO_QUOTA).job_id == "b1"
    view = queue.view(waiting, [{"CPU": 8.0}], held, lambda u: quotas(u) or NO_QUOTA)
    assert view["a2"][0] == 1 and "the user's quota" in view["a2"][1]["reason"]
    assert view["b1"][0] == 2 and view["b1"][1]["reason"] == "being admitted"  # nothing that may start is ahead
    assert queue.next_to_admit(waiting, [{"CPU": 8.0}], {}, lambda u: quotas(u) or NO_QUOTA).job_id == "a2"


def test_the_store_lists_a_users_jobs_and_what_each_users_live_jobs_hold(store):
    add(store, "a1", cpus=2, owner="alice")
    add(store, "a2", cpus=1, owner="alice")
    add(store, "b1", cpus=3, owner="bob")
    assert [j.job_id for j in store.list("alice")] == ["a1", "a2"] and len(store.list()) == 3
    assert store.claim("a1") and store.claim("b1")
    store.update("b1", status=JobStatus.FAILED, error="x")  # ended: holds nothing
    assert store.live_needs() == [("a1", "alice", {"bundle": {"CPU": 2.0}, "count": 1})]
