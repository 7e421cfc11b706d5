"""Lose a worker, lose nothing, through the real service (uvicorn, Ray, gloo): fault drills hang a rank of a
(pp=2) job that checkpoints every three steps, then kill another while the ranks load the checkpoint in that
recovery (fault.max_failures=2), or kill the job's coordinator; each job recovers from its latest checkpoint and
ends SUCCEEDED with losses and final weights bit-identical to an uninterrupted run, and its events list the
failures and the recovery time. (`make test-slow` adds a rank killed as the model is exported at the job's end.)
(The plain kill of one rank, through the service: tests/e2e/test_live_recovery_http.py; from a checkpoint, at the
gloo level: tests/integration/test_checkpoint_gloo.py. Three jobs here, the test cluster's 8 CPUs run them side
by side.)"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import start_service
from helpers import slow, tiny_spec, wait_for, wait_terminal
from safetensors.torch import load_file
from trainyard.cli.client import ApiError
from trainyard.parallel.io.export import MODEL_FILE

SPEC = tiny_spec(model={"n_layer": 4}, steps=8, global_batch=8, checkpoint={"every": 3},
                 parallel={"pp": 2, "microbatches": 2},
                 fault={"max_failures": 2, "hang_floor_s": 30, "from_replica": False})  # the checkpoint path
HANG_FLOOR_S = 3
"""The hang drill's job only: a step that waits on another job's start is no hang of the others."""
DRILLS = {"coordinator": [("kill_coordinator", 0, 4)],
          # a failure during a recovery is one more failure, not the end: rank 1 hangs at step 4, then rank 0 dies
          # while the ranks load the checkpoint in that recovery (before, the second failure failed the job: the
          # recovery ran inside the handler of the first)
          "hang": [("kill_worker_in_recovery", 0, 0), ("hang_worker", 1, 4)]}


@pytest.fixture(scope="module")
def runs(service) -> dict[str, tuple[dict, list[dict]]]:
    """Every drill's job and an uninterrupted one, submitted at once (three pp=2 jobs); each drill is scheduled
    once its job runs."""
    client = service.client()
    jobs = {name: client.submit({**SPEC, "name": name} | ({"fault": {**SPEC["fault"], "hang_floor_s": HANG_FLOOR_S}}
                                                          if name == "hang" else {}))
            for name in ("reference", *DRILLS)}
    for name, drills in DRILLS.items():
        wait_for(lambda j=jobs[name]: client.job(j)["status"] == "RUNNING", 300, f"the {name} job to run")
        for kind, rank, at_step in drills:
            client._call("POST", f"/api/jobs/{jobs[name]}/faults",
                         json={"kind": kind, "rank": rank, "at_step": at_step})
    out = {}
    for name, job_id in jobs.items():
        job = wait_terminal(client, job_id, timeout_s=300)
        assert job["status"] == "SUCCEEDED", (name, job["error"], client.events(job_id))
        out[name] = job, client.metrics(job_id)
    client.close()
    return out


@pytest.mark.parametrize("drill", DRILLS)
def test_the_job_recovers_bit_identically(runs, drill, client, tmp_path):
    (reference, ref_rows), (job, rows) = runs["reference"], runs[drill]
    assert [r["step"] for r in rows] == list(range(8))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]
    weights = [load_file(str(client.download_model(j["job_id"], tmp_path / f"{i}-{MODEL_FILE}")))
               for i, j in enumerate((reference, job))]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def _check_first_failure(events: list[dict], failure: dict, cause: str) -> None:
    """The drill struck as its rank started step 4 (its peers may notice while they finish step 3: then no step is
    lost), the job went back to the checkpoint of step 3 and took less than two minutes to recover."""
    assert failure["restore_step"] == 3 and failure["step"] in (3, 4)
    assert failure["steps_lost"] == failure["step"] - 3
    assert cause in failure["cause"]
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert len(recovered) == 1 and 0 < recovered[0]["recovery_s"] < 120
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [3, 6]


def test_events_list_the_coordinators_death_and_the_recovery_time(runs, client):
    job, _ = runs["coordinator"]
    events = client.events(job["job_id"])
    failures = [e for e in events if e["kind"] == "failure"]
    assert len(failures) == 1
    # no rank failed; all died with the coordinator that owned them
    assert failures[0]["ranks"] == [] and "the coordinator died" in failures[0]["cause"]
    _check_first_failure(events, failures[0], "died")


def test_a_hung_rank_then_a_rank_killed_during_its_recovery_are_recovered_from(runs, client):
    job, _ = runs["hang"]
    events = client.events(job["job_id"])
    failures = [e for e in events if e["kind"] == "failure"]
    assert [f["failure"] for f in failures] == [1, 2]
    assert 1 in failures[0]["ranks"]  # with its peers: a hang stalls the ranks waiting on it too
    _check_first_failure(events, failures[0], "hung")
    assert failures[1]["ranks"] == [0] and "loading the checkpoint of step 3" in failures[1]["cause"]  # ... and then
    assert failures[1]["restore_step"] == 3
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert recovered[0]["failure"] == 2  # one recovery, from both


@slow
def test_a_rank_killed_as_the_model_is_exported_is_recovered_from(runs, client, tmp_path):
    """Rank 0 dies as it exports the model at the job's end, after the final checkpoint. The soak found it (a node
    removed during an export): the death escaped the coordinator as its own error and failed the job with a
    traceback. It is a failure like any: back to the final checkpoint, nothing lost, the export again. (A job of
    its own, some 10 s: `make test-slow`.)"""
    job_id = client.submit({**SPEC, "name": "export"})
    wait_for(lambda: client.job(job_id)["status"] == "RUNNING", 300, "the job to run")
    client._call("POST", f"/api/jobs/{job_id}/faults", json={"kind": "kill_worker_in_export", "rank": 0})
    job = wait_terminal(client, job_id, timeout_s=300)
    assert job["status"] == "SUCCEEDED", job["error"]
    [export] = [e for e in client.events(job_id) if e["kind"] == "failure"]
    assert "the model's export" in export["cause"] and "died" in export["cause"] and export["ranks"] == [0]
    assert export["restore_step"] == 8 and export["steps_lost"] == 0
    reference, ref_rows = runs["reference"]
    assert [r["loss"] for r in client.metrics(job_id)] == [r["loss"] for r in ref_rows]
    weights = [load_file(str(client.download_model(j, tmp_path / f"{i}-{MODEL_FILE}")))
               for i, j in enumerate((reference["job_id"], job_id))]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_drills_are_refused_unless_the_service_allows_them(ray_session, tmp_path):
    svc = start_service(tmp_path, allow_fault_injection=False)
    client = svc.client()
    try:
        with pytest.raises(ApiError) as info:
            client._call("POST", "/api/jobs/nosuchjob/faults", json={"kind": "kill_worker", "rank": 0})
        assert info.value.status_code == 403 and "--allow-fault-injection" in str(info.value)
    finally:
        client.close()
        svc.shutdown()


def test_a_drill_needs_a_running_job_and_an_existing_rank(runs, client):
    job, _ = runs["reference"]
    with pytest.raises(ApiError) as info:
        client._call("POST", f"/api/jobs/{job['job_id']}/faults", json={"kind": "kill_worker", "rank": 0})
    assert info.value.status_code == 409


def _failed_by_drill(client, drill: str) -> tuple[str, dict]:
    """A dp=2 job that may recover three times, `drill` on rank 1 at step 4: its id and its end, FAILED."""
    job_id = client.submit(tiny_spec(name=drill, steps=8, parallel={"dp": 2}, fault={"max_failures": 3}))
    wait_for(lambda: client.job(job_id)["status"] == "RUNNING", 300, "the job to run")
    client._call("POST", f"/api/jobs/{job_id}/faults", json={"kind": drill, "rank": 1, "at_step": 4})
    job = wait_terminal(client, job_id, timeout_s=300)
    assert job["status"] == "FAILED", job
    return job_id, job


@slow
def test_a_rank_out_of_memory_fails_the_job_once_saying_so(service):
    """The rank's address space is capped and its step 4 asks for more, which the OS refuses (the oom_worker
    drill): the job ends FAILED at once with an error naming the rank, the step and the plan's prediction,
    although fault.max_failures would allow three recoveries: the same layout would run out again."""
    client = service.client()
    job_id, job = _failed_by_drill(client, "oom_worker")
    assert "rank 1" in job["error"] and "step 4" in job["error"] and "can't allocate memory" in job["error"]
    assert "Out of memory: the plan predicted rank 1:" in job["error"] and "Not retried" in job["error"]
    assert "resident peak measured before it" in job["error"]  # the ranks' peak RSS reached the coordinator
    events = client.events(job_id)
    assert not [e for e in events if e["kind"] in ("recovered", "failure")], events
    # Step 3's figures come with step 4's call (one step late), which failed: a job that fails has no row for them
    assert [r["step"] for r in client.metrics(job_id)] == [0, 1, 2]
    assert all(r["peak_rss_bytes"] > 0 for r in client.metrics(job_id))
    client.close()


@slow
def test_a_rank_the_kernel_s_oom_killer_kills_fails_the_job_once_saying_so(service):
    """A real kernel OOM kill: rank 1 moves into a memory cgroup of its own limited to 64 MiB more and asks for
    1 GiB (the oom_kill_worker drill); the kernel SIGKILLs it, with no Python error, which Ray reports as it reports
    any crash. The OOM-kill count of the rank's cgroup, read at its setup and after its death, tells them apart:
    the job ends FAILED at once, naming the rank, its node, the count, its peak and the plan's prediction,
    although fault.max_failures would allow three recoveries. Needs a writable memory cgroup (root here)."""
    from trainyard.actors.worker_group.oom_killer import child_cgroup

    if child_cgroup("probe") is None or os.geteuid() != 0:
        pytest.skip("no writable memory cgroup here")
    client = service.client()
    job_id, job = _failed_by_drill(client, "oom_kill_worker")
    error = job["error"]
    assert error.startswith("rank 1 (") and " died in step 4: its process exited" in error.splitlines()[0], error
    assert "the kernel's OOM killer killed it: the oom_kill count of its memory cgroup" in error, error
    assert "Out of memory: the plan predicted rank 1:" in error and "rank 1's last measured resident peak" in error
    assert "Not retried" in error and "Traceback" not in error
    events = client.events(job_id)
    assert not [e for e in events if e["kind"] in ("recovered", "failure")], events
    # step 3's figures came with step 4's call (one step late), which failed: no row for them
    assert [r["step"] for r in client.metrics(job_id)] == [0, 1, 2]
    client.close()
    for leftover in child_cgroup("probe").parent.glob("trainyard-drill-*"):  # the drill's cgroups, empty now
        leftover.rmdir()


def test_the_oom_kill_counts_are_read_on_a_rank_s_node_by_a_pinned_task(service):
    """What the coordinator reads after a rank on another node died: a task pinned to that node (here the one
    node) reads the counts of the cgroup the rank named, as the rank would have."""
    import asyncio

    import ray
    from trainyard.actors.worker_group.oom_killer import OomCounts, read_by_task, read_oom_counters

    here = read_oom_counters()
    read = asyncio.run(read_by_task(ray.get_runtime_context().get_node_id(), here["cgroup_path"]))
    assert read is not None and read.cgroup_path == here["cgroup_path"]
    assert (read.kernel is None) == (here["kernel"] is None) and (read.cgroup is None) == (here["cgroup"] is None)
    assert read == OomCounts(**read_oom_counters())  # (no OOM kill meanwhile: the same counts)
