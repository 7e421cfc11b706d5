"""(`make test-slow`; these layouts' numerics: tests/integration/*_gloo.py.) Pipeline jobs through the real service: a
(dp=2, pp=2, tp=2) job's metrics report the bubble and per-stage times; the plan shows the schedule. (A stage that
raises fails the job while its neighbour waits for it: tests/e2e/test_ops_http.py, whose failing job is a pipeline.)
Every schedule and layout against the single rank's losses is checked on gloo
(tests/integration/test_pipeline_gloo.py)."""

from __future__ import annotations

import pytest
from helpers import SLOW, tiny_spec
from trainyard.actors.naming import worker_name

pytestmark = SLOW  # the 8-rank 3D job (conftest.three_d_job): its numerics are the gloo tests'


def pipeline_spec(**parallel) -> dict:
    return tiny_spec(model={"n_layer": 8}, global_batch=12, steps=3, parallel=parallel)


def test_pipeline_metrics_report_bubble_and_per_stage_times(three_d_job):
    job, rows = three_d_job
    assert worker_name(job["job_id"], "pp1-tp1-dp1-experts2-3") in job["actors"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert 0.0 <= row["bubble_fraction"] < 1.0
        assert len(row["stage_forward_s"]) == len(row["stage_backward_s"]) == 2
        assert all(t > 0 for t in row["stage_forward_s"] + row["stage_backward_s"])
        assert row["stage_peak_activations"] == [2, 1]  # 1f1b, two micro-batches
        assert len(row["stage_peak_activation_mb"]) == 2


def test_plan_endpoint_shows_the_schedule(client):
    plan = client.plan(pipeline_spec(pp=4, vpp=2, microbatches=6, schedule="interleaved-1f1b"))
    schedule = plan["schedule"]
    assert schedule["kind"] == "interleaved-1f1b" and len(schedule["stages"]) == 4
    assert schedule["bubble_fraction"] == pytest.approx(3 / (2 * 6 + 3))
    assert len(schedule["peak_activations"]) == 4
