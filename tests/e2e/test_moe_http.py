"""(`make test-slow`; these layouts' numerics: tests/integration/*_gloo.py.) A mixture-of-experts job through the real
service (uvicorn, Ray, gloo): the flagship job (`three_d_job`: llama at dp=2, ep=2, pp=2, tp=2) carries every MoE
layer's per-expert load in its metrics and names its workers by the experts they host; and the plan and rules of the
API. The numerics (every layout on the single-rank curve, dropless and with a capacity factor, recomputed blocks) are
checked on gloo: tests/integration/test_moe_gloo.py."""

from __future__ import annotations

import pytest
from helpers import SLOW, tiny_spec
from trainyard.actors.naming import worker_name

TOKENS_PER_STEP = 8 * 16  # global_batch x seq_len

pytestmark = SLOW  # the 8-rank 3D job (conftest.three_d_job): its numerics are the gloo tests'


def moe_spec(**parallel) -> dict:
    moe = {"experts": 4, "top_k": 2, "every": 2}
    return tiny_spec(model={"n_layer": 4, "moe": moe}, global_batch=8, steps=3, parallel=parallel)


def test_metrics_give_every_moe_layers_load_summing_to_the_tokens_routed(three_d_job):
    _, rows = three_d_job
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["loss"] < rows[0]["loss"]
    for row in rows:
        assert sorted(row["moe"]) == ["1", "3"]  # blocks 1 and 3 are MoE (every=2), on different stages
        for layer in row["moe"].values():
            assert len(layer["load"]) == 4
            assert sum(layer["load"]) == TOKENS_PER_STEP * 2  # top_k = 2
            assert layer["dropped_fraction"] == 0.0
            assert 1.0 <= layer["aux_loss"] < 4.0 and layer["z_loss"] > 0


def test_workers_are_named_by_the_experts_they_host(three_d_job):
    job, _ = three_d_job
    assert [r["name"] for r in job["ranks"]][:4] == ["pp0-tp0-dp0-experts0-1", "pp0-tp1-dp0-experts0-1",
                                                     "pp0-tp0-dp1-experts2-3", "pp0-tp1-dp1-experts2-3"]
    assert worker_name(job["job_id"], "pp1-tp0-dp1-experts2-3") in job["actors"]


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
