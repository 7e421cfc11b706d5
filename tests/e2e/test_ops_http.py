"""Running it like a service, end to end: a pipeline stage that raises fails the job with its traceback while its
neighbour waits for it; the ranks' logs (read from Ray, also after the job ended) and the CLI that follows them.
(Ray's Prometheus export of a running job: test_running_job_http.py.)"""

from __future__ import annotations

import pytest
import ray
from conftest import start_service
from helpers import live_actor, slow, tiny_spec, wait_for, wait_terminal, with_one_bad_token
from trainyard.cli.client import ApiError
from trainyard.cli.main import main as cli
from trainyard.service.logs import read_rank_log

TRACEBACK = "Traceback (most recent call last):"


def run_cli(service, *args: str) -> int:
    return cli(["--url", service.url, "--token", service.token, *args])


@pytest.fixture(scope="module")
def failing(service, tmp_path_factory) -> tuple[str, int]:
    """A (pp=2, 1F1B) job, just submitted, whose micro-batch 1 holds a bad token: stage 0 (rank 0) fails reading it
    in step 0, after sending micro-batch 0 on, and stage 1 (rank 1) blocks receiving micro-batch 1's activation.
    (job id, the token's offset)"""
    spec, offset = with_one_bad_token(tiny_spec(parallel={"pp": 2, "microbatches": 2, "schedule": "1f1b"},
                                                model={"vocab_size": 300}, steps=3, fault={"max_failures": 0}),
                                      tmp_path_factory.mktemp("bad"), bad_dp_rank=0, bad_microbatch=1)
    client = service.client()
    job_id = client.submit(spec)
    client.close()
    return job_id, offset


@pytest.fixture(scope="module")
def two_rank_job(service, failing) -> str:
    """The failing job once it ended (both its ranks started, and logged, before rank 0 failed)."""
    client = service.client()
    assert wait_terminal(client, failing[0])["status"] == "FAILED"
    client.close()
    return failing[0]


def placement_group_state(job_id: str) -> str | None:
    states = [pg["state"] for pg in ray.util.placement_group_table().values() if pg["name"] == f"trainyard/{job_id}"]
    return states[-1] if states else None


@slow
def test_a_failing_stage_fails_the_job_its_log_holds_the_traceback_and_the_cli_follows_it(service, client, failing,
                                                                                          capsys):
    # Only rank 0 reads the bad token: it raises in step 0 while rank 1 waits for its activation from a peer that
    # has died, until the coordinator kills both. The job must still end, FAILED, with rank 0's error. Following
    # starts at submit, so the CLI waits for the workers, then the lines.
    job_id, offset = failing
    assert run_cli(service, "logs", job_id, "--rank", "0", "--follow") == 0
    followed = capsys.readouterr().out.splitlines()
    job = wait_terminal(client, job_id)
    assert job["status"] == "FAILED"
    assert "rank 0 (pp0-tp0-dp0) failed in step 0" in job["error"]
    # The error names the rule, never the data (neither the id nor where it is).
    assert "Traceback" in job["error"] and "holds token ids outside model.vocab_size=300" in job["error"]
    assert f"offset {offset}" not in job["error"]
    wait_for(lambda: not any(live_actor(n) for n in job["actors"]), 30, "actors to be gone")
    wait_for(lambda: placement_group_state(job_id) == "REMOVED", 30, "placement group removal")

    # After the job ended (its actors are dead), Ray still serves the logs.
    rank0 = client.logs(job_id, rank=0)["ranks"][0]
    assert rank0["name"] == "pp0-tp0-dp0" and rank0["error"] is None
    assert "rank 0 failed in step 0:" in rank0["lines"] and TRACEBACK in rank0["lines"]
    assert any("holds token ids outside model.vocab_size=300" in line for line in rank0["lines"])
    assert followed == rank0["lines"]  # every line once, in order, none missing
    both = client.logs(job_id)["ranks"]
    assert [r["rank"] for r in both] == [0, 1]
    assert not any("Traceback" in line for line in both[1]["lines"])

    last_two = client.logs(job_id, rank=0, tail=2)["ranks"][0]
    assert last_two["lines"] == rank0["lines"][-2:] and last_two["next"] == rank0["next"] == len(rank0["lines"])
    assert client.logs(job_id, rank=0, since=rank0["next"])["ranks"][0]["lines"] == []

    assert run_cli(service, "logs", job_id) == 0
    assert f"[rank 0 pp0-tp0-dp0] {TRACEBACK}" in capsys.readouterr().out.splitlines()


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
