"""(`make test-slow`; these layouts' numerics: tests/integration/*_gloo.py.) Tensor, sequence and 3D parallelism through
the real service (uvicorn, Ray, gloo): a (dp=2, pp=2, tp=2, ep=2) llama MoE job trains, follows its one-rank curve and
shows where each rank runs; the plan shows the tp groups and bundles; the rules are 422s. Every layout's numerics
against the single rank are checked on gloo (tests/integration/test_tensor_parallel_gloo.py, test_llama_gloo.py)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import SLOW, THREE_D_SPEC, tiny_spec
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.local_world import PlanRun, run_plan
from trainyard.parallel.spec import parse_spec

pytestmark = SLOW  # the 8-rank 3D job (conftest.three_d_job): its numerics are the gloo tests'


def tp_spec(**parallel) -> dict:
    return tiny_spec(model={"n_layer": 4, "n_head": 2}, global_batch=8, steps=3, parallel=parallel)


def test_a_3d_job_trains_and_shows_every_rank_and_its_node(three_d_job):
    job, rows = three_d_job
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["loss"] < rows[0]["loss"]
    assert [r["name"] for r in job["ranks"]] == [f"pp{p}-tp{t}-dp{d}-experts{2 * d}-{2 * d + 1}" for p in range(2)
                                                 for d in range(2) for t in range(2)]
    assert all(r["node"] and r["node_id"] and r["pid"] for r in job["ranks"])
    assert len(job["actors"]) == 1 + 8


def test_the_3d_llama_job_follows_its_single_rank_curve(three_d_job):
    """Through the real service, llama with grouped-query attention and experts at (dp2, pp2, tp2, ep2, 1f1b) gives
    the losses of the same job on one rank (run on a gloo rank by the same driver the workers use) within 1e-4."""
    _, rows = three_d_job
    one_rank = make_plan(parse_spec({**THREE_D_SPEC, "parallel": {}}))
    (result,) = run_plan(PlanRun(one_rank))
    np.testing.assert_allclose([r["loss"] for r in rows], [s["loss"] for s in result.stats], rtol=1e-4)


def test_plan_shows_tp_groups_and_bundles(client):
    plan = client.plan(tp_spec(dp=2, pp=2, tp=2, microbatches=2))
    assert plan["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [r["bundle"] for r in plan["ranks"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert plan["resources"]["bundles"] == [{"CPU": 2.0}] * 4


@pytest.mark.parametrize("parallel,field,text", [
    ({"tp": 3}, "parallel.tp", "tp=3 does not divide n_head=2"),
    ({"sp": True}, "parallel.sp", "tp > 1"),
])
def test_tensor_parallel_rules_are_422_naming_the_field(client, parallel, field, text):
    response = client._http.post("/api/jobs", json=tp_spec(**parallel))
    assert response.status_code == 422
    assert any(d["field"] == field and text in d["msg"] for d in response.json()["detail"]), response.json()
