"""Running it like a service, end to end: the ranks' logs (read from Ray, also after the job ended), the CLI
that follows them, and Ray's Prometheus export of the trainyard metrics."""

from __future__ import annotations

import math
import re

import httpx
import pytest
import ray
from conftest import start_service
from helpers import tiny_spec, wait_for, wait_terminal, with_one_bad_token

from service.cli import main as cli
from service.client import ApiError
from service.logs import read_rank_log

TRACEBACK = "Traceback (most recent call last):"


def run_cli(service, *args: str) -> int:
    return cli(["--url", service.url, "--token", service.token, *args])


def test_a_failing_rank_log_holds_its_traceback_and_the_cli_follows_it(service, client, tmp_path, capsys):
    # Only rank 1 reads the bad token: it raises in step 0 while rank 0 waits in the all-reduce, until the
    # coordinator kills both. Following starts at submit, so the CLI waits for the workers, then the lines.
    spec, offset = with_one_bad_token(tiny_spec(parallel={"dp": 2}, model={"vocab_size": 300}, steps=3),
                                      tmp_path, bad_dp_rank=1, bad_microbatch=0)
    job_id = client.submit(spec)
    assert run_cli(service, "logs", job_id, "--rank", "1", "--follow") == 0
    followed = capsys.readouterr().out.splitlines()
    assert client.job(job_id)["status"] == "FAILED"

    # After the job ended (its actors are dead), Ray still serves the logs.
    rank1 = client.logs(job_id, rank=1)["ranks"][0]
    assert rank1["name"] == "pp0-tp0-dp1" and rank1["error"] is None
    assert "rank 1 failed in step 0:" in rank1["lines"] and TRACEBACK in rank1["lines"]
    assert any(f"token id 300 at offset {offset}" in line for line in rank1["lines"])
    assert followed == rank1["lines"]  # every line once, in order, none missing
    both = client.logs(job_id)["ranks"]
    assert [r["rank"] for r in both] == [0, 1]
    assert not any("Traceback" in line for line in both[0]["lines"])

    last_two = client.logs(job_id, rank=1, tail=2)["ranks"][0]
    assert last_two["lines"] == rank1["lines"][-2:] and last_two["next"] == rank1["next"] == len(rank1["lines"])
    assert client.logs(job_id, rank=1, since=rank1["next"])["ranks"][0]["lines"] == []

    assert run_cli(service, "logs", job_id) == 0
    assert f"[rank 1 pp0-tp0-dp1] {TRACEBACK}" in capsys.readouterr().out.splitlines()


@pytest.fixture(scope="module")
def two_rank_job(service) -> str:
    client = service.client()
    job_id = client.submit(tiny_spec(steps=1, parallel={"dp": 2}))
    assert wait_terminal(client, job_id)["status"] == "SUCCEEDED"
    client.close()
    return job_id


def test_an_ended_jobs_rank_logs_say_where_each_rank_ran(client, two_rank_job):
    ranks = client.job(two_rank_job)["ranks"]
    logs = client.logs(two_rank_job)["ranks"]
    assert [r["rank"] for r in logs] == [0, 1]
    for where, log in zip(ranks, logs, strict=True):
        assert log["pid"] == where["pid"] and log["error"] is None
        assert (f"job {two_rank_job} rank {where['rank']} ({where['name']}) of 2 ready on {where['node']} "
                f"(pid {where['pid']}, cpu)") in log["lines"]



def test_a_rank_log_is_found_by_pid_without_an_actor_id_and_a_lost_one_says_why(client, two_rank_job):
    where = client.job(two_rank_job)["ranks"][1]
    by_actor = read_rank_log(where)
    assert by_actor["lines"] and by_actor["error"] is None
    without_id = {key: value for key, value in where.items() if key != "actor_id"}  # ranks stored before actor_id
    assert read_rank_log(without_id)["lines"] == by_actor["lines"]
    lost = read_rank_log({**where, "actor_id": "ab" * 16})  # e.g. a job of an earlier Ray session
    assert lost["lines"] == [] and lost["next"] == 0 and "Ray does not hold this rank's stderr" in lost["error"]


@pytest.mark.parametrize("params,status,text", [
    ({"rank": 2}, 404, "has no rank 2; its ranks are 0 to 1"),
    ({"since": 3}, 422, "give `rank` too"),
    ({"tail": 0}, 422, "greater than or equal to 1"),
    ({"rank": 0, "stream": "both"}, 422, "'stderr' or 'stdout'"),
])
def test_logs_requests_are_checked_against_the_job(client, two_rank_job, params, status, text):
    response = client._http.get(f"/api/jobs/{two_rank_job}/logs", params=params)
    assert response.status_code == status and text in response.text, response.text


def test_a_job_without_workers_has_no_logs_yet(ray_session, tmp_path):
    svc = start_service(tmp_path, admit=False)  # every job stays queued
    client = svc.client()
    try:
        job_id = client.submit(tiny_spec())
        with pytest.raises(ApiError) as info:
            client.logs(job_id)
        assert info.value.status_code == 409 and "PENDING and has not started its workers yet" in str(info.value)
        client.stop(job_id)
        with pytest.raises(ApiError) as info:
            client.logs(job_id)
        assert info.value.status_code == 409 and "STOPPED and never started its workers" in str(info.value)
    finally:
        svc.shutdown()


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


def test_ray_exports_a_running_jobs_metrics_to_prometheus_with_its_job_id(client):
    job_id = client.submit(tiny_spec(steps=100_000, name="prometheus"))
    try:
        wait_for(lambda: client.job(job_id)["step"] >= 1, what="the job to finish a step")
        node = next(n for n in ray.nodes() if n["Alive"])
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        names = {f"ray_trainyard_{m}" for m in ("step", "loss", "tokens_per_s", "step_time_s", "bubble_fraction",
                                                   "stage_forward_s", "stage_backward_s")}
        series = wait_for(lambda: (s := trainyard_series(url, job_id)).keys() >= names and s, 120,
                          f"Ray's export at {url} to show {sorted(names)} for job {job_id}")
        assert client.job(job_id)["status"] == "RUNNING"
    finally:
        client.stop(job_id)
    tags, loss = series["ray_trainyard_loss"]
    assert tags["job_id"] == job_id and math.isfinite(loss) and loss > 0
    assert series["ray_trainyard_step"][1] >= 1
    assert series["ray_trainyard_stage_forward_s"][0]["stage"] == "0"
