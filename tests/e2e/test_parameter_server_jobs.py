"""A job with `parallel.sync.kind: parameter_server` through the service: the coordinator makes the shards
(`WorkerGroup.start_shards`), each dp rank pulls, computes its share's gradient and pushes it (`ServerClient`).

- BSP at dp=2 (AdamW, two shards) follows the same spec under all-reduce: every step's loss within 1e-6 relative,
  the exported models (the shards' parameters, pulled into the ranks before the final checkpoint) alike; every
  row names each replica's staleness (0) and pace, and the job's `parameter_server` event counts the updates.
- (`make test-slow`) SSP at s=1 and ASP finish their steps, SSP's every update carrying staleness <= 1.
Shards and replicas without the service: tests/e2e/test_parameter_server_ray.py."""

from __future__ import annotations

import pytest
from helpers import run_all, slow, tiny_spec
from safetensors.torch import load_file
from trainyard.parallel.io.export import MODEL_FILE

STEPS = 4


def spec(sync: dict) -> dict:
    # No clipping: a replica clips its own share's gradient (the shards never see the whole step's), which equals
    # all-reduce's clip of the mean only where it does not bind.
    return tiny_spec(steps=STEPS, optimizer={"kind": "adamw", "lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.0},
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
def test_ssp_and_asp_jobs_finish_within_their_staleness(client):
    jobs = run_all(client, {"ssp": spec({"kind": "parameter_server", "consistency": "ssp", "staleness": 1}),
                            "asp": spec({"kind": "parameter_server", "consistency": "asp"})})
    for name, (job, rows) in jobs.items():
        assert [r["step"] for r in rows] == list(range(STEPS)), name
        [event] = [e for e in client.events(job["job_id"]) if e["kind"] == "parameter_server"]
        assert event["updates"] == 2 * STEPS  # each replica's every push applied alone
    assert max(max(r["ps_staleness"]) for r in jobs["ssp"][1]) <= 1
