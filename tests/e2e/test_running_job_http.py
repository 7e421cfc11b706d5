"""What the service says about a job while it runs, on one shared long job (dp=2, far more steps than it gets to
run), in this order: Ray exports its metrics to Prometheus with its job id; it cannot be deleted (409) nor its
model downloaded (409); stopping it releases its actors and placement group, and then it can be deleted."""

from __future__ import annotations

import math
import re
from pathlib import Path

import httpx
import pytest
import ray
from helpers import live_actor, tiny_spec, wait_for
from trainyard.cli.client import ApiError

STEPS = 100_000


@pytest.fixture(scope="module")
def running(service):
    """A dp=2 job that has made a step and goes on (until the last test stops it)."""
    client = service.client()
    job_id = client.submit(tiny_spec(steps=STEPS, parallel={"dp": 2}, name="running"))
    wait_for(lambda: client.job(job_id)["step"] >= 1, what="the job to finish a step")
    yield job_id
    try:
        client.stop(job_id)  # when a test before the last failed
    except ApiError:
        pass  # stopped and deleted by the last test
    client.close()


_SERIES = re.compile(r"^(ray_trainyard_\w+)\{(.*)\} (\S+)$")


def trainyard_series(url: str, job_id: str) -> dict[str, tuple[dict, float]]:
    """name -> (tags, value) of the exported trainyard series of `job_id` (stage 0 for per-stage ones)."""
    out = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        match = _SERIES.match(line)
        if match:
            tags = dict(re.findall(r'(\w+)="([^"]*)"', match[2]))
            if tags.get("job_id") == job_id and tags.get("stage", "0") == "0":
                out[match[1]] = (tags, float(match[3]))
    return out


def test_ray_exports_a_running_jobs_metrics_to_prometheus_with_its_job_id(client, running):
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    names = {f"ray_trainyard_{m}" for m in ("step", "loss", "tokens_per_s", "step_time_s", "bubble_fraction",
                                               "stage_forward_s", "stage_backward_s")}
    series = wait_for(lambda: (s := trainyard_series(url, running)).keys() >= names and s, 120,
                      f"Ray's export at {url} to show {sorted(names)} for job {running}")
    assert client.job(running)["status"] == "RUNNING"
    tags, loss = series["ray_trainyard_loss"]
    assert tags["job_id"] == running and math.isfinite(loss) and loss > 0
    assert series["ray_trainyard_step"][1] >= 1
    assert series["ray_trainyard_stage_forward_s"][0]["stage"] == "0"


def test_a_running_job_cannot_be_deleted(client, running):
    with pytest.raises(ApiError) as info:
        client.delete(running)
    assert info.value.status_code == 409
    assert client.job(running)["status"] == "RUNNING"


def test_the_model_of_a_job_that_has_not_ended_is_a_409(client, running):
    with pytest.raises(ApiError) as info:
        client.download_model(running, Path("/nonexistent/model"))
    assert info.value.status_code == 409


def placement_group_state(job_id: str) -> str | None:
    states = [pg["state"] for pg in ray.util.placement_group_table().values() if pg["name"] == f"trainyard/{job_id}"]
    return states[-1] if states else None


def test_stopping_a_running_job_releases_its_actors_and_placement_group_and_then_it_can_be_deleted(client, running):
    names = client.job(running)["actors"]
    assert len(names) == 3 and all(live_actor(n) for n in names)  # the coordinator and two workers
    job = client.stop(running)
    assert job["status"] == "STOPPED" and job["step"] < STEPS
    # every step's row, those run since the service's last poll too (the stop's report once held none of them)
    assert [r["step"] for r in client.metrics(running)] == list(range(job["step"]))
    wait_for(lambda: not any(live_actor(n) for n in names), 30, "actors to be gone")
    wait_for(lambda: placement_group_state(running) == "REMOVED", 30, "placement group removal")
    assert client.job(running)["status"] == "STOPPED"
    client.delete(running)
    with pytest.raises(ApiError) as info:
        client.job(running)
    assert info.value.status_code == 404
