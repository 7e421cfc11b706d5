"""Pipeline jobs through the real service: every schedule and layout follows the dp=pp=1 loss curve."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import live_actor, run_all, tiny_spec, wait_for, wait_terminal, with_one_bad_token

from actors.naming import worker_name

# 12 sequences a step: 3 and 6 micro-batches, neither a multiple of pp=2 or pp=4.
LAYOUTS = [
    {"pp": 2, "microbatches": 3, "schedule": "gpipe"},
    {"pp": 2, "microbatches": 3, "schedule": "1f1b"},
    {"pp": 2, "dp": 2, "microbatches": 3, "schedule": "gpipe"},
    {"pp": 2, "dp": 2, "microbatches": 3, "schedule": "1f1b"},
    {"pp": 4, "vpp": 2, "microbatches": 6, "schedule": "gpipe"},
    {"pp": 4, "vpp": 2, "microbatches": 6, "schedule": "interleaved-1f1b"},
]


def pipeline_spec(**parallel) -> dict:
    return tiny_spec(model={"n_layer": 8}, global_batch=12, steps=3, parallel=parallel)


@pytest.fixture(scope="module")
def finished(service) -> dict[str, tuple[dict, list[dict]]]:
    """Submit the reference and every layout at once (they queue for resources), then collect them."""
    client = service.client()
    out = run_all(client, {"reference": pipeline_spec(dp=1, pp=1)} | {_id(p): pipeline_spec(**p) for p in LAYOUTS})
    client.close()
    return out


def _id(parallel: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in parallel.items())


@pytest.mark.parametrize("parallel", LAYOUTS, ids=_id)
def test_pipeline_layout_follows_the_single_rank_loss_curve(parallel, finished):
    reference = [r["loss"] for r in finished["reference"][1]]
    assert reference[-1] < reference[0]
    job, rows = finished[_id(parallel)]
    assert [r["step"] for r in rows] == [0, 1, 2]
    np.testing.assert_allclose([r["loss"] for r in rows], reference, rtol=1e-4)


@pytest.mark.parametrize("parallel", LAYOUTS, ids=_id)
def test_pipeline_metrics_report_bubble_and_per_stage_times(parallel, finished):
    job, rows = finished[_id(parallel)]
    pp, dp = parallel["pp"], parallel.get("dp", 1)
    assert len(job["actors"]) == 1 + pp * dp
    assert worker_name(job["job_id"], f"pp{pp - 1}-tp0-dp{dp - 1}") in job["actors"]
    for row in rows:
        assert 0.0 <= row["bubble_fraction"] < 1.0
        assert len(row["stage_forward_s"]) == len(row["stage_backward_s"]) == pp
        assert all(t > 0 for t in row["stage_forward_s"] + row["stage_backward_s"])
        assert len(row["stage_peak_activations"]) == pp


def test_gpipe_holds_more_activations_than_1f1b(finished):
    gpipe = finished["pp2-microbatches3-schedulegpipe"][1][-1]
    one_f_one_b = finished["pp2-microbatches3-schedule1f1b"][1][-1]
    assert gpipe["stage_peak_activations"] == [3, 3]
    assert one_f_one_b["stage_peak_activations"] == [2, 1]
    assert one_f_one_b["stage_peak_activation_mb"][0] < gpipe["stage_peak_activation_mb"][0]


def test_plan_endpoint_shows_the_schedule(client):
    plan = client.plan(pipeline_spec(pp=4, vpp=2, microbatches=6, schedule="interleaved-1f1b"))
    schedule = plan["schedule"]
    assert schedule["kind"] == "interleaved-1f1b" and len(schedule["stages"]) == 4
    assert schedule["bubble_fraction"] == pytest.approx(3 / (2 * 6 + 3))
    assert len(schedule["peak_activations"]) == 4


def test_a_stage_that_raises_fails_the_job_while_its_neighbour_waits_for_it(client, tmp_path):
    # Micro-batch 1 holds a bad token: stage 0 fails reading it, after sending micro-batch 0 on, and
    # stage 1 blocks receiving micro-batch 1's activation. The job must end FAILED with stage 0's error.
    spec, offset = with_one_bad_token(
        pipeline_spec(pp=2, microbatches=2, schedule="1f1b") | {"model": {"n_layer": 4, "n_head": 2, "d_model": 32,
                                                                         "vocab_size": 300, "seq_len": 16}},
        tmp_path, bad_dp_rank=0, bad_microbatch=1)
    job = wait_terminal(client, client.submit(spec))
    assert job["status"] == "FAILED"
    assert "rank 0 (pp0-tp0-dp0) failed in step 0" in job["error"]
    assert "Traceback" in job["error"] and f"token id 300 at offset {offset}" in job["error"]
    wait_for(lambda: not any(live_actor(name) for name in job["actors"]), 30, "actors to be gone")
