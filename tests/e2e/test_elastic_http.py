"""Resize a running job through the real service: dp 2 -> 4 -> 1 with the state moved in memory, and, at the same time,
a (pp=2, dp=2) ZeRO-3 job (FSDP2 shards) to dp=1 through a checkpoint. Each follows the loss curve of the same job on
one rank (run on a gloo rank by the same driver the workers use; the ZeRO-3 job in `make test-slow`: a resume at another
layout through a checkpoint is checked on gloo ranks in tests/integration/test_checkpoint_gloo.py) within 1e-4 per step,
until it is stopped; the ranks that remain keep their actors (same actor ids); every resize is an event; a bad size is a
422 and a job that is not running a 409. And a coordinator Ray restarts removes the placement groups its predecessor
reserved to grow (they stayed reserved until the job ended)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from helpers import SLOW, SLOW_TESTS, tiny_spec, wait_for
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


@pytest.fixture(scope="module")
def runs(service):
    """Both jobs at once (4 + 4 ranks at most), each resized in its own thread, then both stopped; then the one-rank
    runs of both specs for as many steps, in one spawned gloo world."""
    def resize_and_stop(spec: dict, sizes: tuple[int, ...]) -> tuple:
        client = service.client()  # one per thread
        job_id = client.submit(spec)
        wait_for(lambda: client.job(job_id)["ranks"] and client.job(job_id)["step"] >= 1, 120, "the job to run")
        actors = [_actors(client, job_id)] + [_resize(client, job_id, dp) for dp in sizes]
        past = client.job(job_id)["step"] + AFTER
        wait_for(lambda: client.job(job_id)["step"] >= past, 120, f"{AFTER} steps at the last size")
        assert client.stop(job_id)["status"] == "STOPPED", client.job(job_id)["error"]
        out = client.metrics(job_id), actors, client.events(job_id), job_id
        client.close()
        return out

    jobs = (("dp", DP, (4, 1)), *((("pp", PIPE, (1,)),) if SLOW_TESTS else ()))
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(resize_and_stop, spec, sizes) for name, spec, sizes in jobs}
        done = {name: f.result() for name, f in futures.items()}
    one_rank = {name: PlanRun(make_plan(parse_spec({**spec, "parallel": {}})), steps=range(len(done[name][0])))
                for name, spec in (("dp", DP), ("pp", PIPE)) if name in done}
    references = dict(zip(one_rank, run_plans(list(one_rank.values())), strict=True))
    return {name: ([{"step": i, "loss": s["loss"]} for i, s in enumerate(references[name][0].stats)], *done[name])
            for name in done}


@pytest.mark.parametrize("name", ["dp", pytest.param("pp", marks=SLOW)])
def test_a_resized_job_follows_the_one_rank_loss_curve(runs, name):
    reference, resized, _, _, _ = runs[name]
    assert [r["step"] for r in resized] == list(range(len(resized)))
    assert len(reference) == len(resized)
    for ref, row in zip(reference, resized, strict=True):
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-4), row["step"]


def test_ranks_that_remain_keep_their_actors(runs):
    _, _, (at2, at4, at1), _, _ = runs["dp"]
    assert set(at2) == {"pp0-tp0-dp0", "pp0-tp0-dp1"} and len(at4) == 4 and set(at1) == {"pp0-tp0-dp0"}
    assert {k: at4[k] for k in at2} == at2  # growing added two actors and kept both
    assert at1["pp0-tp0-dp0"] == at2["pp0-tp0-dp0"]  # shrinking kept the first
    assert len(set(at4.values())) == 4


@pytest.mark.parametrize(("name", "moves"), [("dp", [(2, 4, "memory"), (4, 1, "memory")]),
                                             pytest.param("pp", [(2, 1, "checkpoint")], marks=SLOW)])
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


def test_a_restarted_coordinator_removes_the_placement_groups_its_predecessor_reserved_to_grow(ray_session, tmp_path):
    """A job grown past its admitted size holds `<name>-growN` placement groups, reserved by its coordinator (the dp
    job above grows into one). When that coordinator dies, Ray restarts it with its arguments: the admitted layout,
    its ranks new, the grown groups not its own. They stayed reserved, out of every job's reach and their names
    taken, until the job ended; the restarted coordinator removes them first. Here a coordinator is created as the
    service creates it (never started: no ranks), with a grown group beside its admitted one, then killed."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from trainyard.actors.coordinator import Coordinator, JobStorage
    from trainyard.actors.naming import coordinator_name, placement_group_name

    job, plan = "regrown", make_plan(parse_spec(tiny_spec()))
    admitted = placement_group(plan.bundles(), name=placement_group_name(job), lifetime="detached")
    grown = placement_group([{"CPU": 0.01}], name=f"{placement_group_name(job)}-grow0", lifetime="detached")
    ray.get([admitted.ready(), grown.ready()], timeout=60)
    storage = JobStorage(checkpoint_root=str(tmp_path / "ckpt"), model_path=str(tmp_path / "model.safetensors"))
    coordinator = Coordinator.options(name=coordinator_name(job), lifetime="detached",  # type: ignore[attr-defined]
                                      max_restarts=1).remote(job, plan, admitted, storage)
    try:
        ray.get(coordinator.actor_names.remote(), timeout=60)  # up (a poll would start a restarted one's job)
        assert _grown(job) == [f"trainyard/{job}-grow0"]
        ray.kill(coordinator, no_restart=False)  # its process dies; Ray restarts it
        wait_for(lambda: _grown(job) == [], 60, "the restarted coordinator to remove the grown placement group")
        assert ray.util.placement_group_table(admitted)["state"] == "CREATED"  # the service's, kept
    finally:
        ray.kill(coordinator, no_restart=True)
        remove_placement_group(admitted)


def _grown(job_id: str) -> list[str]:
    """The placement groups a coordinator of the job reserved to grow that Ray still holds."""
    return [e["name"] for e in ray.util.placement_group_table().values()
            if e["name"].startswith(f"trainyard/{job_id}-grow") and e["state"] != "REMOVED"]
