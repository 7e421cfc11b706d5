"""Recovery from a live replica, through the real service (uvicorn, Ray, gloo): a dp=2 all-reduce job with no
`fault` section (so this is also issue 32's "a job with no fault section survives one kill_worker drill": the
default fault.max_failures is 3) and no checkpoint loses rank 1 at step 20 (a kill_worker drill); rank 0, the
other replica of the same shard, still holds the state of step 20, so the new rank 1 takes it by broadcast and
the job resumes at step 20: no step lost, no checkpoint read, losses and final weights bit-identical to an
uninterrupted run."""

from __future__ import annotations

import torch
from helpers import tiny_spec, wait_for, wait_terminal
from safetensors.torch import load_file
from trainyard.parallel.export import MODEL_FILE

SPEC = tiny_spec(steps=24, parallel={"dp": 2}, name="live")  # no fault section, no checkpoint section


def test_a_killed_rank_takes_the_state_of_its_live_replica_and_no_step_is_lost(client, tmp_path):
    reference, drilled = client.submit(SPEC), client.submit(SPEC)
    wait_for(lambda: client.job(drilled)["status"] == "RUNNING", 120, "the job to run")
    client._call("POST", f"/api/jobs/{drilled}/faults", json={"kind": "kill_worker", "rank": 1, "at_step": 20})
    jobs = [wait_terminal(client, job_id, timeout_s=300) for job_id in (reference, drilled)]
    assert all(job["status"] == "SUCCEEDED" for job in jobs), [job["error"] for job in jobs]

    events = client.events(drilled)
    failures = [e for e in events if e["kind"] == "failure"]
    assert len(failures) == 1, events
    failure = failures[0]
    assert failure["ranks"] == [1] and "died" in failure["cause"]
    assert failure["recovered_from"] == "replica"
    # The death is charged to step 20, or to step 19 when rank 1's answer to it was lost with it (rank 0 then
    # holds step 20, and the row of step 19 is made from the answers that came back): resumed at 20 either way.
    assert failure["step"] in (19, 20) and (failure["restore_step"], failure["steps_lost"]) == (20, 0)
    assert [e["kind"] for e in events].count("recovered") == 1

    ref_rows, rows = client.metrics(reference), client.metrics(drilled)
    assert [r["step"] for r in rows] == list(range(24))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]
    weights = [load_file(str(client.download_model(j, tmp_path / f"{i}-{MODEL_FILE}")))
               for i, j in enumerate((reference, drilled))]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
