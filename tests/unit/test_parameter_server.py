"""The parameter server's pure rules (`parallel.plan.sync.parameter_server`: the BSP / SSP / ASP clock, the staleness an
update carries, the shards' map), one shard's math (`ShardState`, in process) and the combinations the plan refuses.
The shards as Ray actors, with replicas pushing and pulling: tests/e2e/test_parameter_server_ray.py."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_spec
from trainyard.parallel.config import OptimizerConfig
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.plan.sync.parameter_server import (
    ASP_AHEAD,
    assign_shards,
    bound,
    may_start,
    push_weight,
    server_event,
    staleness_of,
    steps_ahead,
)
from trainyard.parallel.runtime.sync.parameter_server import ShardState
from trainyard.parallel.spec import parse_spec


def test_ssp_lets_a_worker_start_step_t_once_every_worker_finished_step_t_minus_1_minus_s():
    finished = [5, 3]  # worker 0 finished steps 0..4, worker 1 steps 0..2
    assert [t for t in range(10) if may_start(t, finished, "ssp", staleness=2)] == [0, 1, 2, 3, 4, 5]
    assert may_start(3, finished, "ssp", 0) and not may_start(4, finished, "ssp", 0)


def test_bsp_is_lockstep_whatever_the_staleness_and_asp_never_waits():
    finished = [5, 3]
    assert [t for t in range(8) if may_start(t, finished, "bsp", 0)] == [0, 1, 2, 3]
    assert bound("bsp", 7) == 0 and bound("ssp", 7) == 7 and bound("asp", 7) is None
    assert all(may_start(t, finished, "asp") for t in range(100))
    assert [may_start(t, finished, "ssp", 0) for t in range(8)] == [may_start(t, finished, "bsp", 0) for t in range(8)]


def test_the_staleness_of_an_update_is_how_far_its_worker_ran_ahead_of_the_slowest():
    assert staleness_of(3, [3, 3]) == 0  # lockstep
    assert staleness_of(5, [5, 3]) == 2
    assert all(staleness_of(t, f) <= 2 for f in ([5, 3], [4, 4], [6, 4]) for t in range(10)
               if may_start(t, f, "ssp", 2))


def test_shards_balance_the_parameters_by_size_the_same_on_every_process():
    sizes = [100, 10, 60, 50, 10, 1]
    owner = assign_shards(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owner, strict=True) if o == k) for k in range(2)]
    assert owner == assign_shards(sizes, 2) and sorted(loads) == [111, 120]
    assert assign_shards(sizes, 1) == [0] * 6 and sorted(set(assign_shards(sizes, 6))) == list(range(6))


def test_ssp_and_asp_weigh_each_push_as_one_worker_of_the_mean():
    assert push_weight("bsp", 4) == 1.0 and push_weight("ssp", 4) == push_weight("asp", 4) == 0.25


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_bsp_shard_applies_the_mean_of_a_steps_pushes_once_as_the_optimizer_would(kind):
    params = _grads(0)
    cfg = OptimizerConfig(kind=kind, lr=0.1, warmup_steps=0, schedule="constant")
    shard = ShardState(params, cfg, steps=4, consistency="bsp", workers=2)
    assert shard.receive(0, 0, _grads(1)) == []  # waits for the other worker
    (applied,) = shard.receive(1, 0, _grads(2))
    assert (applied.step, applied.worker, applied.version) == (0, -1, 1)
    reference = [p.clone().requires_grad_() for p in params]
    from trainyard.parallel.optim.optimizer import make_optimizer

    opt = make_optimizer([(t, t) for t in reference], cfg)
    for t, a, b in zip(reference, _grads(1), _grads(2), strict=True):
        t.grad = (a + b) / 2
    opt.step()
    for mine, theirs in zip(shard.tensors, reference, strict=True):
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-7)


def test_with_plain_sgd_two_pushes_applied_apart_make_the_bsp_step():
    params, cfg = _grads(0), OptimizerConfig(kind="sgd", lr=0.1, beta1=0.0, warmup_steps=0, schedule="constant",
                                             weight_decay=0.0)
    bsp, ssp = (ShardState(params, cfg, steps=2, consistency=c, workers=2) for c in ("bsp", "ssp"))
    for worker in (0, 1):
        bsp.receive(worker, 0, _grads(worker + 1))
        ssp.receive(worker, 0, _grads(worker + 1))
    assert len(ssp.applied) == 2 and len(bsp.applied) == 1
    for a, b in zip(bsp.tensors, ssp.tensors, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("parallel", "top", "field"), [
    ({"dp": 2, "pp": 2, "microbatches": 2}, {}, "parallel.pp"),
    ({"dp": 2, "zero": 1}, {}, "parallel.zero"),
    ({"dp": 2, "sync": {"consistency": "asp", "staleness": 2}}, {}, "parallel.sync.staleness"),
    ({"dp": 2}, {"checkpoint": {"every": 2}}, "checkpoint.every"),
    ({"dp": 2}, {"resume_from": {"job_id": "j1"}}, "resume_from"),
    ({"dp": {"min": 1, "max": 2}}, {}, "parallel.sync"),
], ids=["pipeline-replica", "zero", "staleness-without-ssp", "checkpoints-between-steps", "resume", "elastic"])
def test_what_a_parameter_server_does_not_take_is_refused_naming_the_field(parallel, top, field):
    sync = {"kind": "parameter_server", **parallel.pop("sync", {})}
    spec = tiny_spec(model={"n_layer": 2}, parallel={**parallel, "sync": sync}, **top)
    with pytest.raises(PlanError) as info:
        make_plan(parse_spec(spec))
    assert info.value.field == field


def test_a_parameter_server_job_is_planned_with_replicas_of_one_rank_and_is_not_resized():
    from trainyard.parallel.plan import resize_plan

    plan = make_plan(parse_spec(tiny_spec(parallel={"dp": 2, "sync": {"kind": "parameter_server", "shards": 2}})))
    assert plan.sync.server and plan.reduce_dp == 1
    assert make_plan(parse_spec(tiny_spec(parallel={"dp": 2}))).reduce_dp == 2  # allreduce: one replica of both
    with pytest.raises(PlanError, match="clock") as info:
        resize_plan(plan, 4)
    assert info.value.field == "parallel.sync"


def test_the_job_loop_queues_ahead_as_far_as_the_consistency_lets_a_replica_run():
    assert steps_ahead("bsp", 0) == 1  # lockstep: one queued ahead, as every other sync mode
    assert steps_ahead("ssp", 0) == 1 and steps_ahead("ssp", 3) == 3
    assert steps_ahead("asp", 0) == ASP_AHEAD


def test_the_server_event_counts_updates_by_staleness_and_worker():
    updates = [{"step": 0, "worker": 0, "staleness": 0, "version": 1}, {"step": 0, "worker": 1, "staleness": 0,
               "version": 2}, {"step": 1, "worker": 0, "staleness": 1, "version": 3}]
    event = server_event(updates, workers=2)
    assert (event["updates"], event["max_staleness"], event["mean_staleness"]) == (3, 1, pytest.approx(1 / 3))
    assert event["staleness_counts"] == {"0": 2, "1": 1} and event["updates_by_worker"] == [2, 1]
    bsp = server_event([{"step": s, "worker": -1, "staleness": 0, "version": s + 1} for s in range(3)], workers=2)
    assert bsp["updates_by_worker"] == [3, 3]  # BSP's mean is every worker's update
    assert server_event([], workers=2)["max_staleness"] == 0


def test_a_slow_rank_drill_reaches_its_rank_once_with_its_factor_and_the_api_bounds_the_factor():
    from pydantic import ValidationError
    from trainyard.actors.actions.requests import Drills
    from trainyard.api.models import FaultDrill

    drills = Drills()
    drills.add("slow_rank", rank=1, at_step=2, factor=3.0)
    assert drills.due_on_ranks(1) == {}
    (drill,) = drills.due_on_ranks(2).values()
    assert (drill.kind, drill.rank, drill.factor) == ("slow_rank", 1, 3.0) and drills.due_on_ranks(3) == {}
    assert FaultDrill(kind="slow_rank", rank=1).factor == 3.0
    with pytest.raises(ValidationError, match="factor"):
        FaultDrill(kind="slow_rank", rank=1, factor=0.5)
