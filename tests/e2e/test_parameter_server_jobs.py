"""A job with `parallel.sync.kind: parameter_server` through the service: the coordinator makes the shards
(`WorkerGroup.start_shards`), each dp rank pulls, computes its share's gradient and pushes it (`ServerClient`).

- BSP at dp=2 (AdamW, two shards) follows the same spec under all-reduce: every step's loss within 1e-6 relative,
  the exported models (the shards' parameters, pulled into the ranks before the final checkpoint) alike; every
  row names each replica's staleness (0) and pace, and the job's `parameter_server` event counts the updates.
- (`make test-slow`) SSP at s=1 and ASP finish their steps, SSP's every update carrying staleness <= 1, ASP's fast
  replica running more than a step ahead of one slowed 6x (the slow_rank drill); a BSP job
  whose rank dies at step 2 goes back to the start (new shards) and ends with the undisturbed job's losses.
Shards and replicas without the service: tests/e2e/test_parameter_server_ray.py."""

from __future__ import annotations

import pytest
from helpers import run_all, slow, tiny_spec, wait_for, wait_terminal
from safetensors.torch import load_file
from trainyard.parallel.io.export import MODEL_FILE

STEPS = 4


def spec(sync: dict, steps: int = STEPS) -> dict:
    # No clipping: a replica clips its own share's gradient (the shards never see the whole step's), which equals
    # all-reduce's clip of the mean only where it does not bind.
    return tiny_spec(steps=steps, optimizer={"kind": "adamw", "lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.0},
                     parallel={"dp": 2, "sync": sync})


def test_bsp_equals_allreduce_data_parallelism(client, tmp_path):
    jobs = run_all(client, {"allreduce": spec({"kind": "allreduce"}),
                            "bsp": spec({"kind": "parameter_server", "consistency": "bsp", "shards": 2})})
    (ar_job, ar_rows), (ps_job, ps_rows) = jobs["allreduce"], jobs["bsp"]
    assert [r["step"] for r in ps_rows] == list(range(STEPS))
    assert [r["loss"] for r in ps_rows] == pytest.approx([r["loss"] for r in ar_rows], rel=1e-6)
    assert all(r["ps_staleness"] == [0, 0] and len(r["ps_pace_s"]) == 2 for r in ps_rows)
    assert ar_rows[0].get("ps_staleness") is None
    [event] = [e for e in client.events(ps_job["job_id"]) if e["kind"] == "parameter_server"]
    assert (event["updates"], event["max_staleness"], event["updates_by_worker"]) == (STEPS, 0, [STEPS, STEPS])
    # The export is the shards' parameters: trained, and as all-reduce's
    ps = load_file(str(client.download_model(ps_job["job_id"], tmp_path / f"ps-{MODEL_FILE}")))
    ar = load_file(str(client.download_model(ar_job["job_id"], tmp_path / f"ar-{MODEL_FILE}")))
    assert ps.keys() == ar.keys()
    for name in ar:
        assert ps[name].allclose(ar[name], rtol=1e-4, atol=1e-6), name


@slow
def test_ssp_and_asp_jobs_finish_within_their_staleness_and_a_bsp_job_recovers_from_a_lost_rank(client):
    bsp = spec({"kind": "parameter_server", "consistency": "bsp"})
    jobs = {"ssp": client.submit(spec({"kind": "parameter_server", "consistency": "ssp", "staleness": 1})),
            "asp": client.submit(spec({"kind": "parameter_server", "consistency": "asp"}, steps=2 * STEPS)),
            "bsp": client.submit(bsp), "killed": client.submit({**bsp, "fault": {"max_failures": 1}})}
    drills = {"killed": {"kind": "kill_worker", "rank": 1, "at_step": 2},
              "asp": {"kind": "slow_rank", "rank": 1, "at_step": 1, "factor": 6.0}}
    for name, drill in drills.items():
        wait_for(lambda j=jobs[name]: client.job(j)["status"] == "RUNNING", 300, f"the {name} job to run")
        client._call("POST", f"/api/jobs/{jobs[name]}/faults", json=drill)
    rows = {}
    for name, job_id in jobs.items():
        job = wait_terminal(client, job_id, timeout_s=300)
        assert job["status"] == "SUCCEEDED", (name, job["error"])
        rows[name] = client.metrics(job_id)
        steps = 2 * STEPS if name == "asp" else STEPS
        assert [r["step"] for r in rows[name]] == list(range(steps)), name
        [event] = [e for e in client.events(job_id) if e["kind"] == "parameter_server"]
        if name in ("ssp", "asp"):
            assert event["updates"] == 2 * steps  # each replica's every push applied alone
    assert max(max(r["ps_staleness"]) for r in rows["ssp"]) <= 1
    # ASP with rank 1 six times slower: rank 0 ran on ahead through its own queue. With one step queued ahead of the
    # one awaited (as in lockstep), rank 0 would pull at most two steps ahead of rank 1 (a step's call ends with the
    # pull for the next), so no update could carry a staleness over 2.
    assert max(r["ps_staleness"][0] for r in rows["asp"]) >= 3
    # The lost rank took the job back to the start, the shards made anew from the ranks' initial parameters
    [failure] = [e for e in client.events(jobs["killed"]) if e["kind"] == "failure"]
    assert failure["restore_step"] == 0
    assert [r["loss"] for r in rows["killed"]] == [r["loss"] for r in rows["bsp"]]
