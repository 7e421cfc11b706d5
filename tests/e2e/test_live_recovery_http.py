"""Recovery without a checkpoint, through the real service (uvicorn, Ray, gloo); the three jobs run side by side.

- From a live replica: a dp=2 all-reduce job with no `fault` section (so this is also issue 32's "a job with no
  fault section survives one kill_worker drill": the default fault.max_failures is 3) and no checkpoint loses
  rank 1 at step 20 (a kill_worker drill); rank 0, the other replica of the same shard, still holds the state of
  step 20, so the new rank 1 takes it by broadcast and the job resumes at step 20: no step lost, no checkpoint
  read, losses and final weights bit-identical to an uninterrupted run.
- Replicas that fail alone: a diloco job at dp=3 (no `fault` section) loses rank 2, the whole of replica 2, at
  step 10. Replica 2 is dropped from the round and the two others go on stepping (the rows' `replica_steps`
  show their counters moving while replica 2's stands still); it is rebuilt and rejoins in the next outer sync
  (step 15's) from their state, and the job SUCCEEDS with every step's row once. (The state a rejoining replica
  takes, exactly: tests/integration/test_sync_gloo.py.)
- (`make test-slow`) A stop during a recovery from a live replica keeps the steps no checkpoint holds: the job ends
  STOPPED with a final checkpoint of the step it recovered to and its model."""

from __future__ import annotations

import pytest
import torch
from helpers import slow, tiny_spec, wait_for, wait_terminal
from safetensors.torch import load_file
from trainyard.parallel.io.export import MODEL_FILE

SPEC = tiny_spec(steps=24, parallel={"dp": 2}, name="live")  # no fault section, no checkpoint section
STEPS, EVERY, KILLED, REPLICAS = 24, 8, 2, 3
DILOCO = tiny_spec(steps=STEPS, global_batch=6, name="drop",
                   parallel={"dp": REPLICAS, "sync": {"kind": "diloco", "every": EVERY, "outer_lr": 0.7,
                                               "outer_momentum": 0.9}})


@pytest.fixture(scope="module")
def jobs(service) -> dict[str, str]:
    """The three jobs (2 + 2 + 3 ranks, within the test cluster's 8 CPUs), each drill scheduled once its job runs;
    their ids once all ended."""
    client = service.client()
    ids = {"reference": client.submit(SPEC), "drilled": client.submit(SPEC), "diloco": client.submit(DILOCO)}
    for name, rank, step in (("drilled", 1, 20), ("diloco", KILLED, 10)):
        wait_for(lambda j=ids[name]: client.job(j)["status"] == "RUNNING", 120, f"the {name} job to run")
        client._call("POST", f"/api/jobs/{ids[name]}/faults", json={"kind": "kill_worker", "rank": rank,
                                                                     "at_step": step})
    for name, job_id in ids.items():
        job = wait_terminal(client, job_id, timeout_s=300)
        assert job["status"] == "SUCCEEDED", (name, job["error"])
    client.close()
    return ids


def test_a_killed_rank_takes_the_state_of_its_live_replica_and_no_step_is_lost(jobs, client, tmp_path):
    reference, drilled = jobs["reference"], jobs["drilled"]
    events = client.events(drilled)
    failures = [e for e in events if e["kind"] == "failure"]
    assert len(failures) == 1, events
    failure = failures[0]
    assert failure["ranks"] == [1] and "died" in failure["cause"]
    assert failure["recovered_from"] == "replica"
    # The failure is charged to the first step without a row: 19 (rank 1 died in step 20's call, which brings step
    # 19's figures), or 18 when rank 1's answer to step 19's call was lost with it. Rank 0 holds step 20 either way,
    # and the rows of the steps between are made from the figures it returned or kept: resumed at 20.
    assert failure["step"] in (18, 19) and (failure["restore_step"], failure["steps_lost"]) == (20, 0)
    assert [e["kind"] for e in events].count("recovered") == 1

    ref_rows, rows = client.metrics(reference), client.metrics(drilled)
    assert [r["step"] for r in rows] == list(range(24))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]
    weights = [load_file(str(client.download_model(j, tmp_path / f"{i}-{MODEL_FILE}")))
               for i, j in enumerate((reference, drilled))]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_killed_rank_drops_its_replica_the_others_step_on_and_it_rejoins_at_the_next_sync(jobs, client):
    job_id = jobs["diloco"]
    events = client.events(job_id)
    kinds = [e["kind"] for e in events]
    assert "replica_dropped" in kinds and "replica_rejoined" in kinds, events
    dropped, rejoined = (next(e for e in events if e["kind"] == k) for k in ("replica_dropped", "replica_rejoined"))
    failure = next(e for e in events if e["kind"] == "failure")
    assert kinds.count("failure") == 1 and failure["recovered_from"] == "replicas_left" and failure["steps_lost"] == 0
    rejoins = dropped["rejoins_after_step"]  # the next sync: 15, unless the drill came late
    assert dropped["replicas"] == [KILLED] and dropped["ranks"] == [KILLED] and (rejoins + 1) % EVERY == 0
    assert rejoined["replicas"] == [KILLED] and rejoined["step"] == rejoins + 1

    rows = client.metrics(job_id)
    assert [r["step"] for r in rows] == list(range(STEPS))
    counters = {r["step"]: r["replica_steps"] for r in rows}
    out = [s for s, c in counters.items() if c[KILLED] < s + 1]  # the steps replica 2 sat out
    assert len(out) >= 3 and max(out) == rejoins - 1, counters  # in the sync of step `rejoins` it took their state
    standing = {counters[s][KILLED] for s in out}
    assert len(standing) == 1, counters  # replica 2's counter stood still ...
    for s in out:  # ... while the others' kept moving, one step per row
        assert [c for d, c in enumerate(counters[s]) if d != KILLED] == [s + 1] * (REPLICAS - 1), counters
    assert rejoined["steps_missed"] == [rejoins + 1 - standing.pop()]
    assert all(c == [s + 1] * REPLICAS for s, c in counters.items() if s not in out), counters
    assert all(r["loss"] > 0 for r in rows)


@slow
def test_a_stop_during_a_recovery_from_a_live_replica_keeps_the_steps_no_checkpoint_holds(service, client, tmp_path):
    job_id = client.submit(tiny_spec(steps=100_000, parallel={"dp": 2}, name="stop-in-recovery"))
    wait_for(lambda: client.job(job_id)["status"] == "RUNNING", 120, "the job to run")
    client._call("POST", f"/api/jobs/{job_id}/faults", json={"kind": "kill_worker", "rank": 1, "at_step": 10})
    wait_for(lambda: client.job(job_id)["status"] == "RECOVERING" or any(e["kind"] == "failure" for e in
                                                                        client.events(job_id)), 120, "the failure")
    client.stop(job_id)  # lands while the new rank takes the live replica's state (seconds), or just after
    job = wait_terminal(client, job_id, timeout_s=120)
    rows = client.metrics(job_id)
    assert job["status"] == "STOPPED" and job["error"] is None
    assert rows and job["step"] == rows[-1]["step"] + 1 >= 10  # before: STOPPED with neither checkpoint nor model
    weights = load_file(str(client.download_model(job_id, tmp_path / MODEL_FILE)))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
