"""A failure during a recovery is one more failure, not the end: a (dp=2, pp=2) job with fault.max_failures=2
loses rank 1 at step 4, then rank 0 while the ranks load the checkpoint in that recovery (the
`kill_worker_in_recovery` drill), recovers a second time and SUCCEEDS with every step's row. Before, the
second failure failed the job: the recovery ran inside the handler of the first."""

from __future__ import annotations

from helpers import tiny_spec, wait_for, wait_terminal

SPEC = tiny_spec(model={"n_layer": 4}, steps=8, global_batch=8, checkpoint={"every": 3}, name="twice",
                 parallel={"dp": 2, "pp": 2, "microbatches": 2},
                 fault={"max_failures": 2, "hang_floor_s": 3, "from_replica": False})  # the checkpoint path


def test_a_rank_killed_during_a_recovery_is_recovered_from_too(client):
    job_id = client.submit(SPEC)
    wait_for(lambda: client.job(job_id)["status"] == "RUNNING", 120, "the job to run")
    for kind, rank, at_step in (("kill_worker_in_recovery", 0, 0), ("kill_worker", 1, 4)):
        client._call("POST", f"/api/jobs/{job_id}/faults", json={"kind": kind, "rank": rank, "at_step": at_step})
    job = wait_terminal(client, job_id, timeout_s=300)
    events = client.events(job_id)
    assert job["status"] == "SUCCEEDED", (job["error"], events)
    failures = [e for e in events if e["kind"] == "failure"]
    assert [f["failure"] for f in failures] == [1, 2]
    assert 1 in failures[0]["ranks"] and "died" in failures[0]["cause"]
    assert failures[1]["ranks"] == [0] and "loading the checkpoint of step 3" in failures[1]["cause"]
    assert all(f["restore_step"] == 3 for f in failures)
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["failure"] == 2
    assert [r["step"] for r in client.metrics(job_id)] == list(range(8))
