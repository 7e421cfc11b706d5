"""Speed and memory settings through the real service (uvicorn, Ray, gloo): one (dp=2, pp=2) job with bf16,
selective activation checkpointing and ZeRO-1 at once trains to the end and reports each stage's measured
activation peak. That each setting keeps the numbers and shows its effect is checked on gloo, setting by setting
(tests/integration/test_performance_gloo.py)."""

from __future__ import annotations

import math

from helpers import run_all, slow, tiny_spec

SETTINGS = {"precision": "bf16", "activation_checkpointing": "selective"}


@slow
def test_a_job_with_every_setting_trains_and_reports_stage_activation_peaks(service):
    client = service.client()
    spec = tiny_spec(model={"n_layer": 4}, global_batch=8, steps=5,
                     parallel={"dp": 2, "pp": 2, "microbatches": 2, "zero": 1}, **SETTINGS)
    job, rows = run_all(client, {"job": spec})["job"]
    client.close()
    assert {k: job["spec"][k] for k in SETTINGS} == SETTINGS and job["spec"]["parallel"]["zero"] == 1
    assert [r["step"] for r in rows] == list(range(5))
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
    for row in rows:
        assert len(row["stage_peak_activation_mb"]) == 2 and all(mb > 0 for mb in row["stage_peak_activation_mb"])
        assert row["stage_peak_activations"] == [2, 1]  # 1f1b with two micro-batches
