"""End to end over HTTP: a real uvicorn server, real Ray actors, real gloo process groups. (A running job's
stop, delete and 409s: test_running_job_http.py; a failing rank: test_ops_http.py; the data-parallel layouts'
numerics: tests/integration/test_pipeline_gloo.py.)"""

from __future__ import annotations

import pytest
from helpers import tiny_spec, wait_terminal
from trainyard.actors import tracking
from trainyard.actors.naming import coordinator_name, worker_name
from trainyard.cli.client import ApiError, Client


def test_a_job_reports_progress_and_metrics_rows(client, monkeypatch):
    job_id = client.submit(tiny_spec(steps=3, name="metrics", parallel={"dp": 2}, tracking={"tensorboard": True}))
    job = wait_terminal(client, job_id)
    assert job["status"] == "SUCCEEDED" and job["step"] == 3 and job["steps"] == 3
    assert job["spec"]["name"] == "metrics"
    assert job["actors"] == [coordinator_name(job_id), worker_name(job_id, "pp0-tp0-dp0"),
                             worker_name(job_id, "pp0-tp0-dp1")]
    assert [r["step"] for r in client.metrics(job_id)] == [0, 1, 2]
    rows = client.metrics(job_id, since=1)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert any(j["job_id"] == job_id for j in client.jobs())
    # The coordinator logged each step to TensorBoard where `trainyard tensorboard ID` says.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(client.tracking(job_id)["tensorboard"])
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [0, 1, 2]
    # A tracker not installed on the service's side is a 422 naming the field and the extra.
    monkeypatch.setitem(tracking.LIBRARIES, "mlflow", "mlflow_not_installed_here")
    with pytest.raises(ApiError) as refused:
        client.submit(tiny_spec(steps=1, tracking={"mlflow": {}}))
    assert refused.value.status_code == 422 and "tracking.mlflow" in str(refused.value)
    assert "trainyard[track]" in str(refused.value)


@pytest.mark.parametrize("overrides,field,text", [
    ({"parallel": {"dp": 64}, "global_batch": 64}, "parallel.dp", "can ever hold only 8"),
    ({"global_batch": 6, "parallel": {"dp": 4}}, "global_batch", "not divisible by dp x microbatches"),
    ({"data": {"kind": "text", "path": "/nonexistent/corpus.txt"}}, "data.path", "no such file or directory"),
    ({"model": {"n_head": 3}}, "model.n_head", "n_head=3 does not divide d_model=32"),
    ({"bogus": 1}, "bogus", "unknown field 'bogus'"),
    ({"steps": 0}, "steps", "greater than 0"),
    ({"parallel": {"pp": 2, "vpp": 2, "schedule": "1f1b"}, "model": {"n_layer": 4}}, "parallel.schedule",
     "1f1b needs vpp=1"),
    ({"parallel": {"pp": 2, "stage_layers": [1, 2]}}, "parallel.stage_layers", "sums to 3 but n_layer=2"),
    ({"parallel": {"pp": 4}}, "parallel.pp", "n_layer=2 cannot be split into pp x vpp = 4"),
    # about 1.5 TiB of parameters, gradients and AdamW state on one rank: more than any node's memory
    ({"model": {"d_model": 65536, "n_head": 2}}, "model", "rank 0 (pp0-tp0-dp0) needs 1,537.7 GiB (params 384.1"),
])
def test_invalid_specs_are_422_naming_the_field_and_create_no_job(client, service, overrides, field, text):
    before = len(client.jobs())
    response = client._http.post("/api/jobs", json=tiny_spec(**overrides))
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert any(d["field"] == field and text in d["msg"] for d in detail), detail
    assert len(client.jobs()) == before


def test_plan_endpoint_returns_the_plan_with_resources_and_creates_nothing(client):
    before = len(client.jobs())
    plan = client.plan(tiny_spec(parallel={"dp": 2}))
    assert plan["world_size"] == 2
    assert plan["resources"]["needed"]["CPU"] == 2 and plan["resources"]["available"]["CPU"] == 8
    memory = plan["memory"]["per_rank"]
    assert [m["rank"] for m in memory] == [0, 1] and memory[0]["total"] == memory[1]["total"] > 0
    assert len(client.jobs()) == before


def test_requests_without_the_token_are_refused(service):
    anonymous = Client(service.url, token=None)
    with pytest.raises(ApiError) as info:
        anonymous.jobs()
    assert info.value.status_code == 401
    assert anonymous.healthz()


def test_unknown_job_is_404(client):
    with pytest.raises(ApiError) as info:
        client.job("does-not-exist")
    assert info.value.status_code == 404


def test_cluster_endpoint_shows_ray_resources(client):
    cluster = client.cluster()
    assert cluster["cpus"] == 8 and cluster["nodes"] == 1
