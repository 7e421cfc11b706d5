"""Mixture-of-experts jobs through the real service (uvicorn, Ray, gloo): expert-parallel layouts follow the
single-rank MoE loss curve, dropless and with a capacity factor; the metrics carry every MoE layer's
per-expert load; workers are named by the experts they host; the plan shows them."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run_all, tiny_spec

from actors.naming import worker_name

TOKENS_PER_STEP = 8 * 16  # global_batch x seq_len
LAYOUTS = {
    "dp2-ep2": {"dp": 2, "ep": 2},
    "dp2-ep2-pp2-1f1b": {"dp": 2, "ep": 2, "pp": 2, "microbatches": 2, "schedule": "1f1b"},
}


def moe_spec(capacity_factor: float | None = None, top: dict | None = None, **parallel) -> dict:
    moe = {"experts": 4, "top_k": 2, "every": 2, "capacity_factor": capacity_factor}
    return tiny_spec(model={"n_layer": 4, "moe": moe}, global_batch=8, steps=4, parallel=parallel, **(top or {}))


@pytest.fixture(scope="module")
def finished(service) -> dict[str, tuple[dict, list[dict]]]:
    """The single-rank references and every layout, submitted at once (they queue for resources)."""
    client = service.client()
    specs = {"reference": moe_spec(), "reference-cap1": moe_spec(1.0), "dp2-ep2-cap1": moe_spec(1.0, dp=2, ep=2)}
    specs |= {key: moe_spec(**parallel) for key, parallel in LAYOUTS.items()}
    specs["recompute"] = moe_spec(top={"activation_checkpointing": "full"}, dp=2, ep=2)
    out = run_all(client, specs)
    client.close()
    return out


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropless_expert_parallel_layouts_follow_the_single_rank_curve(layout, finished):
    reference = losses(finished["reference"][1])
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(losses(finished[layout][1]), reference, rtol=1e-4)


def test_with_a_capacity_factor_ep2_follows_its_own_single_rank_curve(finished):
    reference = finished["reference-cap1"][1]
    assert all(r["moe"]["1"]["dropped_fraction"] > 0 for r in reference)  # capacity 1.0 does drop tokens
    np.testing.assert_allclose(losses(finished["dp2-ep2-cap1"][1]), losses(reference), rtol=1e-4)
    assert losses(reference) != losses(finished["reference"][1])


@pytest.mark.parametrize("key", ["reference", "dp2-ep2", "dp2-ep2-pp2-1f1b"])
def test_metrics_give_every_moe_layers_load_summing_to_the_tokens_routed(key, finished):
    for row in finished[key][1]:
        assert sorted(row["moe"]) == ["1", "3"]  # blocks 1 and 3 are MoE (every=2), whichever stage holds them
        for layer in row["moe"].values():
            assert len(layer["load"]) == 4
            assert sum(layer["load"]) == TOKENS_PER_STEP * 2  # top_k = 2
            assert layer["dropped_fraction"] == 0.0
            assert 1.0 <= layer["aux_loss"] < 4.0 and layer["z_loss"] > 0
    first, reference = finished[key][1][0]["moe"], finished["reference"][1][0]["moe"]
    for layer in ("1", "3"):  # the same routing in the first step, whatever the layout
        assert first[layer]["load"] == reference[layer]["load"]
        assert first[layer]["aux_loss"] == pytest.approx(reference[layer]["aux_loss"], rel=1e-4)


def test_recomputed_moe_blocks_keep_the_numbers_and_are_not_counted_twice(finished):
    rows, reference = finished["recompute"][1], finished["reference"][1]
    np.testing.assert_allclose(losses(rows), losses(reference), rtol=1e-5)
    assert [r["moe"]["3"]["load"] for r in rows] == [r["moe"]["3"]["load"] for r in reference]


def test_workers_are_named_by_the_experts_they_host(finished):
    job, _ = finished["dp2-ep2"]
    assert [r["name"] for r in job["ranks"]] == ["pp0-tp0-dp0-experts0-1", "pp0-tp0-dp1-experts2-3"]
    assert worker_name(job["job_id"], "pp0-tp0-dp1-experts2-3") in job["actors"]


def test_plan_shows_the_experts_of_each_rank(client):
    plan = client.plan(moe_spec(dp=4, ep=2))
    assert [r["experts"] for r in plan["ranks"]] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert plan["groups"]["ep"] == [[0, 1], [2, 3]] and plan["groups"]["experts"] == [[0, 2], [1, 3]]


@pytest.mark.parametrize("model,parallel,field,text", [
    ({"moe": {"experts": 4, "top_k": 8}}, {}, "model.moe.top_k", "top_k=8 exceeds experts=4"),
    ({"moe": {"experts": 4}}, {"dp": 2, "ep": 4}, "parallel.ep", "ep=4 does not divide dp=2"),
    ({"moe": {"experts": 4, "every": 9}}, {}, "model.moe.every", "every=9 exceeds n_layer=4"),
])
def test_moe_rules_are_422_naming_the_field(client, model, parallel, field, text):
    spec = tiny_spec(model={"n_layer": 4, **model}, parallel=parallel)
    response = client._http.post("/api/jobs", json=spec)
    assert response.status_code == 422
    assert any(d["field"] == field and text in d["msg"] for d in response.json()["detail"]), response.json()
