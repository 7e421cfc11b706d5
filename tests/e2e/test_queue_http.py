"""The service's queue and its robustness, over HTTP against real Ray: bursts, a stop racing admission, a killed worker
(the order of the queue's policy: tests/unit/test_queue.py); `make test-slow` adds priorities, concurrent stop/delete,
waiting jobs across a restart, a follower that survives a failing job, and `parallel: auto` submitted while the costs
are measured (the admission thread's logic for it: tests/unit/test_calibration_in_background.py)."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from conftest import start_service
from helpers import SLOW_TESTS, slow, tiny_spec, wait_for, wait_terminal
from ray.util.placement_group import placement_group, remove_placement_group
from trainyard.actors.naming import NAMESPACE
from trainyard.actors.state import JobStatus
from trainyard.cli.client import ApiError
from trainyard.parallel.spec import parse_spec
from trainyard.service.manager import JobManager
from trainyard.service.store import JobRecord, JobStore


class HoldTheCluster:
    """Another tenant that holds all 8 CPUs of the test cluster, so that every job must wait."""

    def __enter__(self):
        self.pg = placement_group([{"CPU": 8}])
        assert self.pg.wait(30)
        return self

    def __exit__(self, *exc):
        self.release()

    def release(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def coordinator_names() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].endswith("/coordinator")}


def test_a_burst_of_submits_is_queued_at_once_and_waiting_jobs_hold_no_ray_process(client):
    with HoldTheCluster():
        with ThreadPoolExecutor(16) as pool:
            ids = list(pool.map(lambda i: client.submit(tiny_spec(name=f"burst-{i}")), range(200)))
        assert len(set(ids)) == 200
        listed = [j for j in client.jobs() if j["job_id"] in set(ids)]
        assert len(listed) == 200 and {j["status"] for j in listed} == {"PENDING"}
        by_position = sorted(listed, key=lambda j: j["queue_position"])
        assert [j["queue_position"] for j in by_position] == list(range(1, 201))
        assert [j["created_at"] for j in by_position] == sorted(j["created_at"] for j in listed)
        assert not any(name.split("/")[1] in set(ids) for name in coordinator_names())
        head = client.job(by_position[0]["job_id"])
        assert head["waiting_for"]["needed"] == {"CPU": 1.0, "GPU": 0.0}
        assert "the free resources hold 0 now" in head["waiting_for"]["reason"]
        assert client.job(by_position[1]["job_id"])["waiting_for"]["reason"].startswith("behind 1 earlier job")
        with ThreadPoolExecutor(16) as pool:
            stopped = list(pool.map(client.stop, ids))
    assert {j["status"] for j in stopped} == {"STOPPED"}
    assert all(client.job(i)["admitted_at"] is None for i in ids)  # none ever left the queue


def test_a_full_queue_refuses_a_submit_with_429_and_the_reason(ray_session, tmp_path):
    svc = start_service(tmp_path, admit=False, max_queued=3)
    client = svc.client()
    try:
        for _ in range(3):
            client.submit(tiny_spec())
        with pytest.raises(ApiError) as info:
            client.submit(tiny_spec())
        assert info.value.status_code == 429 and "already holds 3 waiting jobs" in str(info.value)
        assert len(client.jobs()) == 3
    finally:
        svc.shutdown()


@slow
def test_two_jobs_that_cannot_run_together_run_one_after_the_other_in_priority_order(client):
    # Each needs 6 of the 8 CPUs: never both at once.
    spec = tiny_spec(steps=3, resources={"cpus_per_worker": 6})
    with HoldTheCluster() as other_tenant:
        low = client.submit({**spec, "name": "low", "priority": 0})
        high = client.submit({**spec, "name": "high", "priority": 5})
        assert client.job(high)["queue_position"] == 1 and client.job(low)["queue_position"] == 2
        other_tenant.release()
        first, second = wait_terminal(client, high), wait_terminal(client, low)
    assert first["status"] == second["status"] == "SUCCEEDED"
    assert first["admitted_at"] < first["ended_at"] <= second["admitted_at"]


@slow
def test_waiting_jobs_are_still_waiting_after_a_restart_and_then_run(ray_session, tmp_path):
    """... and a job admitted but never started (the service died between reserving its resources and starting
    it) is queued again and runs too."""
    svc = start_service(tmp_path, admit=False)
    ids = {p: svc.client().submit(tiny_spec(steps=2, name=f"p{p}", priority=p)) for p in (0, 2, 1)}
    svc.shutdown()
    store = JobStore(tmp_path / "jobs.db")
    store.insert(JobRecord(job_id="admitted", name="x", status=JobStatus.PENDING, spec=tiny_spec(steps=2), steps=2,
                           needs={"bundle": {"CPU": 1.0}, "count": 1}))
    assert store.claim("admitted")
    store.close()

    svc = start_service(tmp_path, admit=False)
    try:
        jobs = {p: svc.client().job(i) for p, i in ids.items()}
        assert {p: (j["status"], j["queue_position"]) for p, j in jobs.items()} == {
            2: ("PENDING", 1), 1: ("PENDING", 2), 0: ("PENDING", 3)}
        assert svc.client().job("admitted")["queue_position"] == 4
    finally:
        svc.shutdown()

    svc = start_service(tmp_path)
    try:
        done = {p: wait_terminal(svc.client(), i) for p, i in {**ids, "admitted": "admitted"}.items()}
        assert {j["status"] for j in done.values()} == {"SUCCEEDED"}, {p: j.get("error") for p, j in done.items()}
        assert done[2]["admitted_at"] < done[1]["admitted_at"] < done[0]["admitted_at"]
        interrupted = [e for e in svc.client().events("admitted") if e["kind"] == "interrupted"]
        assert len(interrupted) == 1 and "while the job was being started" in interrupted[0]["cause"]
    finally:
        svc.shutdown()


def race_stop_and_delete(http, job_id: str) -> list[int]:
    """Two stops and two deleters retrying as fast as the server answers, all at once; their status codes."""
    codes: list[int] = []

    def stop() -> None:
        codes.append(http.post(f"/api/jobs/{job_id}/stop").status_code)

    def delete_until_gone() -> None:
        for _ in range(2000):
            code = http.delete(f"/api/jobs/{job_id}").status_code
            codes.append(code)
            if code in (204, 404):
                return

    threads = [threading.Thread(target=f) for f in (stop, stop, delete_until_gone, delete_until_gone)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


@slow
def test_concurrent_stop_and_delete_never_answer_5xx_and_the_service_keeps_working(client):
    http = client._http
    ids = [client.submit(tiny_spec(steps=100_000)) for _ in range(2)]  # one rank each: they run side by side
    for job_id in ids:
        wait_for(lambda j=job_id: client.job(j)["step"] >= 1, what="the job to run")
        codes = race_stop_and_delete(http, job_id)
        assert set(codes) <= {200, 204, 404, 409} and 204 in codes, codes
        assert http.get(f"/api/jobs/{job_id}").status_code == 404
        wait_for(lambda j=job_id: f"trainyard/{j}/coordinator" not in coordinator_names(), 30, "the coordinator to go")

    job_id = client.submit(tiny_spec(steps=3))
    seen = set()
    wait_for(lambda: seen.add(s := client.job(job_id)["status"]) or s in ("SUCCEEDED", "FAILED", "STOPPED"))
    assert "RUNNING" in seen and client.job(job_id)["status"] == "SUCCEEDED"


def test_a_killed_worker_fails_its_job_naming_the_rank_whose_process_died(client):
    job_id = client.submit(tiny_spec(steps=100_000, parallel={"dp": 2}, fault={"max_failures": 0}))
    job = wait_for(lambda: (j := client.job(job_id))["step"] >= 1 and len(j["ranks"]) == 2 and j, what="two ranks")
    victim = job["ranks"][1]
    assert victim["name"] == "pp0-tp0-dp1" and victim["node"]
    os.kill(victim["pid"], signal.SIGKILL)
    job = wait_terminal(client, job_id)
    assert job["status"] == "FAILED"
    assert job["error"].startswith("rank 1 (pp0-tp0-dp1) died in step"), job["error"]
    assert f"its process exited (pid {victim['pid']} on node" in job["error"]


class StoreThatFailsOneJob(JobStore):
    """A store whose metrics write fails for one job: a stand-in for any bug in one job's handling."""

    poisoned: str | None = None

    def add_metrics(self, job_id: str, rows: list[dict]) -> None:
        if job_id == self.poisoned:
            raise RuntimeError("disk on fire")
        super().add_metrics(job_id, rows)


@slow
def test_the_follower_survives_an_error_in_one_job_and_fails_only_that_job(ray_session, tmp_path):
    store = StoreThatFailsOneJob(tmp_path / "jobs.db")
    manager = JobManager(store, poll_interval_s=0.1)
    try:
        store.poisoned = manager.submit(parse_spec(tiny_spec(steps=3, name="poisoned")))
        healthy = manager.submit(parse_spec(tiny_spec(steps=3, name="healthy")))
        wait_for(lambda: manager.get(store.poisoned).status.is_terminal and manager.get(healthy).status.is_terminal)
        bad = manager.get(store.poisoned)
        assert bad.status is JobStatus.FAILED and "disk on fire" in bad.error
        assert manager.get(healthy).status is JobStatus.SUCCEEDED
    finally:
        manager.shutdown()
        store.close()


RACES = 20 if SLOW_TESTS else 5
"""Submit-then-stop rounds: each stop lands while its job is queued, being admitted or just started (which phase
is luck, so `make test-slow` runs four times as many)."""


def test_a_stop_racing_admission_never_leaks_a_coordinator_or_a_placement_group(client):
    ids = []
    for i in range(RACES):
        job_id = client.submit(tiny_spec(steps=100_000, name=f"race-{i}"))
        ids.append(job_id)
        assert client.stop(job_id)["status"] == "STOPPED"  # while queued, being admitted, or just started
    assert {client.job(j)["status"] for j in ids} == {"STOPPED"}
    wait_for(lambda: not any(name.split("/")[1] in ids for name in coordinator_names()), 60, "coordinators to go")
    groups = [pg for pg in ray.util.placement_group_table().values() if pg["name"].split("/")[-1] in ids]
    wait_for(lambda: all(ray.util.placement_group_table()[pg["placement_group_id"]]["state"] == "REMOVED"
                         for pg in groups), 60, "placement groups to be removed")


@slow
def test_parallel_auto_submitted_while_calibrating_is_queued_then_planned_and_run(ray_session, tmp_path):
    """A submit is never refused for what the service can wait out: `parallel: auto` while the node type's
    costs are being measured is a 201 and a PENDING job whose event says why it waits (a plan request is still
    a 503 with Retry-After); once the costs are known the admission thread chooses its layout and runs it."""
    from trainyard.parallel.plan.planner.calibration import node_type, store_costs
    from trainyard.parallel.plan.planner.machine_costs import default_gpu_costs

    measured = threading.Event()

    def measure(state_dir, cluster):  # stands in for the minute-long `calibrate.machine_costs`, which it writes
        assert measured.wait(60)
        store_costs(state_dir, node_type(cluster), default_gpu_costs(node_type(cluster)))

    svc = start_service(tmp_path / "state")
    svc.manager.calibrations._measure = measure
    client = svc.client()
    try:
        job_id = client.submit({**tiny_spec(name="auto"), "parallel": "auto"})
        job = client.job(job_id)
        assert job["status"] == "PENDING" and "measured costs" in job["waiting_for"]["reason"], job
        assert [e["kind"] for e in client.events(job_id)] == ["waiting_for_calibration"]
        with pytest.raises(ApiError, match="503"):
            client.plan({**tiny_spec(), "parallel": "auto"})
        other = client.submit(tiny_spec(name="fixed"))  # the waiting job does not hold the queue
        assert wait_terminal(client, other)["status"] == "SUCCEEDED"
        measured.set()
        job = wait_terminal(client, job_id)
        assert job["status"] == "SUCCEEDED", job
        planned = [e for e in client.events(job_id) if e["kind"] == "planned"]
        assert len(planned) == 1 and planned[0]["layout"]["world_size"] >= 1
    finally:
        client.close()
        svc.shutdown()
