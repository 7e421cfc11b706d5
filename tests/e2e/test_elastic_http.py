"""Resize a running job through the real service: dp 2 -> 4 -> 1 with the state moved in memory, and, at the same
time, a (pp=2, dp=2) ZeRO-3 job (FSDP2 shards) to dp=1 through a checkpoint. Each follows the loss curve of the same
job on one rank (run on a gloo rank by the same driver the workers use) within 1e-4 per step, until it is stopped;
the ranks that remain keep their actors (same actor ids); every resize is an event; a bad size is a 422 and a job
that is not running a 409. Between the dp job's two resizes its coordinator is killed: Ray restarts it at the
admitted dp=2, and it removes the placement group its predecessor reserved to grow to 4 (once left reserved until
the job ended)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from helpers import tiny_spec, wait_for
from trainyard.cli.client import ApiError
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.local_world import PlanRun, run_plans
from trainyard.parallel.spec import parse_spec

STEPS = 100_000
"""More than the jobs get to run: each is stopped once it made a few steps at its last size, so that no job ends
before the test's requests reach it, however slow the machine."""
AFTER = 3
"""Steps the resized job makes at its last size before it is stopped."""
DP = tiny_spec(steps=STEPS, global_batch=8, parallel={"dp": 2, "microbatches": 2}, name="elastic-dp")
PIPE = tiny_spec(model={"n_layer": 4}, steps=STEPS, global_batch=8, name="elastic-pp",
                 parallel={"dp": 2, "pp": 2, "microbatches": 2, "zero": 3})


def _actors(client, job_id: str) -> dict[str, str]:
    """Actor id of each rank, by its (pp, tp, dp) name."""
    return {r["name"]: r["actor_id"] for r in client.job(job_id)["ranks"]}


def _resize(client, job_id: str, dp: int) -> dict:
    """Ask for `dp` a couple of steps from now and wait until the job runs at that size."""
    step = client.job(job_id)["step"]
    wait_for(lambda: client.job(job_id)["step"] >= step + 2, 120, "two more steps")
    client.scale(job_id, dp)
    wait_for(lambda: any(e["kind"] == "resize" and e["to"]["dp"] == dp for e in client.events(job_id))
             and client.job(job_id)["status"] == "RUNNING", 120, f"the job to run at dp={dp}")
    return _actors(client, job_id)


def _grown(job_id: str) -> list[str]:
    """The placement groups a coordinator of the job reserved to grow that Ray still holds."""
    return [e["name"] for e in ray.util.placement_group_table().values()
            if e["name"].startswith(f"trainyard/{job_id}-grow") and e["state"] != "REMOVED"]


def _kill_coordinator(client, job_id: str) -> dict[str, str]:
    """Kill the coordinator at the next step; once Ray restarted it and the job runs again, its actors."""
    client._call("POST", f"/api/jobs/{job_id}/faults",
                 json={"kind": "kill_coordinator", "rank": 0, "at_step": client.job(job_id)["step"] + 1})
    wait_for(lambda: any(e["kind"] == "recovered" for e in client.events(job_id))
             and client.job(job_id)["status"] == "RUNNING", 120, "the restarted coordinator to run the job")
    return _actors(client, job_id)


@pytest.fixture(scope="module")
def runs(service):
    """Both jobs at once (4 + 4 ranks at most), each resized in its own thread, then both stopped; then the one-rank
    runs of both specs for as many steps, in one spawned gloo world."""
    def resize_and_stop(spec: dict, sizes: tuple[int, ...]) -> tuple:
        client = service.client()  # one per thread
        job_id = client.submit(spec)
        wait_for(lambda: client.job(job_id)["ranks"] and client.job(job_id)["step"] >= 1, 120, "the job to run")
        actors = [_actors(client, job_id)]
        for dp in sizes:
            if dp == "kill":
                grown = _grown(job_id)
                actors.append(_kill_coordinator(client, job_id))
                assert grown and _grown(job_id) == [], grown  # reserved at dp=4, removed by the restarted one
            else:
                actors.append(_resize(client, job_id, dp))
        past = client.job(job_id)["step"] + AFTER
        wait_for(lambda: client.job(job_id)["step"] >= past, 120, f"{AFTER} steps at the last size")
        assert client.stop(job_id)["status"] == "STOPPED", client.job(job_id)["error"]
        out = client.metrics(job_id), actors, client.events(job_id), job_id
        client.close()
        return out

    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(resize_and_stop, spec, sizes) for name, spec, sizes in (("dp", DP, (4, "kill", 1)),
                                                                                            ("pp", PIPE, (1,)))}
        done = {name: f.result() for name, f in futures.items()}
    one_rank = {name: PlanRun(make_plan(parse_spec({**spec, "parallel": {}})), steps=range(len(done[name][0])))
                for name, spec in (("dp", DP), ("pp", PIPE))}
    references = dict(zip(one_rank, run_plans(list(one_rank.values())), strict=True))
    return {name: ([{"step": i, "loss": s["loss"]} for i, s in enumerate(references[name][0].stats)], *done[name])
            for name in done}


@pytest.mark.parametrize("name", ["dp", "pp"])
def test_a_resized_job_follows_the_one_rank_loss_curve(runs, name):
    reference, resized, _, _, _ = runs[name]
    assert [r["step"] for r in resized] == list(range(len(resized)))
    assert len(reference) == len(resized)
    for ref, row in zip(reference, resized, strict=True):
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-4), row["step"]


def test_ranks_that_remain_keep_their_actors(runs):
    _, _, (at2, at4, restarted, at1), _, _ = runs["dp"]
    assert set(at2) == {"pp0-tp0-dp0", "pp0-tp0-dp1"} and len(at4) == 4 and set(at1) == {"pp0-tp0-dp0"}
    assert {k: at4[k] for k in at2} == at2  # growing added two actors and kept both
    assert set(restarted) == set(at2) and not set(restarted.values()) & set(at4.values())  # new, at the admitted dp
    assert at1["pp0-tp0-dp0"] == restarted["pp0-tp0-dp0"]  # shrinking kept the first
    assert len(set(at4.values())) == 4


@pytest.mark.parametrize(("name", "moves"), [("dp", [(2, 4, "memory"), (2, 1, "memory")]),
                                             ("pp", [(2, 1, "checkpoint")])])
def test_every_resize_is_an_event(runs, name, moves):
    events = [e for e in runs[name][3] if e["kind"] == "resize"]
    assert [(e["from"]["dp"], e["to"]["dp"], e["moved"]) for e in events] == moves
    assert all(e["reason"] == "request" and e["paused_s"] > 0 for e in events)
    if name == "dp":
        assert [e["to"]["microbatches"] for e in events] == [1, 4]  # the global batch of 8 stays


def test_bad_sizes_are_422_and_a_job_that_does_not_run_is_409(runs, client):
    job_id = runs["dp"][4]  # ended
    with pytest.raises(ApiError) as info:
        client.scale(job_id, 3)
    assert info.value.status_code == 422 and "dp=3" in str(info.value) and "global_batch=8" in str(info.value)
    with pytest.raises(ApiError) as info:
        client.scale(job_id, 1)
    assert info.value.status_code == 409 and "only a RUNNING job can be resized" in str(info.value)
