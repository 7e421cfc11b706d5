"""Tensor, sequence and 3D parallelism through the real service (uvicorn, Ray, gloo): every layout follows
the dp=pp=tp=1 loss curve, and the job shows where each rank runs."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run_all, tiny_spec

LAYOUTS = [
    {"tp": 2},
    {"tp": 2, "sp": True},
    {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2, "schedule": "1f1b"},
    {"pp": 2, "vpp": 2, "tp": 2, "microbatches": 2, "schedule": "interleaved-1f1b"},
]


def tp_spec(**parallel) -> dict:
    return tiny_spec(model={"n_layer": 4, "n_head": 2}, global_batch=8, steps=3, parallel=parallel)


def _id(parallel: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in parallel.items())


@pytest.fixture(scope="module")
def finished(service) -> dict[str, tuple[dict, list[dict]]]:
    """Submit the reference and every layout at once (they queue for resources), then collect them."""
    client = service.client()
    out = run_all(client, {"reference": tp_spec()} | {_id(p): tp_spec(**p) for p in LAYOUTS})
    client.close()
    return out


@pytest.mark.parametrize("parallel", LAYOUTS, ids=_id)
def test_tensor_parallel_layout_follows_the_single_rank_loss_curve(parallel, finished):
    reference = [r["loss"] for r in finished["reference"][1]]
    assert reference[-1] < reference[0]
    job, rows = finished[_id(parallel)]
    np.testing.assert_allclose([r["loss"] for r in rows], reference, rtol=1e-4)
    np.testing.assert_allclose([r["grad_norm"] for r in rows], [r["grad_norm"] for r in finished["reference"][1]],
                               rtol=1e-4)


def test_a_3d_job_shows_every_rank_and_its_node(finished):
    job, _ = finished[_id(LAYOUTS[2])]
    assert [r["name"] for r in job["ranks"]] == [f"pp{p}-tp{t}-dp{d}" for p in range(2) for d in range(2)
                                                 for t in range(2)]
    assert all(r["node"] and r["node_id"] and r["pid"] for r in job["ranks"])
    assert len(job["actors"]) == 1 + 8


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
