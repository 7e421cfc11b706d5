"""A parameter server on real Ray: shards as actors (`actors.ps_shard`), replicas as Ray tasks pulling the
parameters, computing the gradient of their share of each step's batch and pushing it (`Replica`), on a tiny model.

- BSP at dp=2 follows all-reduce data parallelism's curve (AdamW, every step's loss and the final weights within
  1e-5): one process applying the replicas' mean gradient with the same optimizer and schedule.
- (`make test-slow`) SSP at staleness 0 over two shards equals BSP (plain SGD: each push applied alone, weighted
  1 / workers, adds up to the mean): against the same all-reduce math.
- (`make test-slow`) SSP at s=2 and ASP with one replica slowed 3x (the slow_rank drill's rule) finish, SSP's every
  update carrying staleness <= 2."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from helpers import slow
from trainyard.actors.ps_shard import RayTransport, ps_shards
from trainyard.parallel.config import OptimizerConfig, SyncConfig
from trainyard.parallel.optim.lr_schedules import lr_at
from trainyard.parallel.optim.optimizer import make_optimizer, set_lr
from trainyard.parallel.runtime.sync.parameter_server import Replica

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replicas' model and data live here
STEPS, WORKERS = 4, 2


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def share_loss(model: torch.nn.Module, step: int, worker: int) -> torch.Tensor:
    """The MSE on `worker`'s share of step `step`'s batch (a function of the step and the worker only)."""
    g = torch.Generator().manual_seed(1000 * step + worker)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


@ray.remote(num_cpus=0)
def replica(shards: list, owner: list[int], worker: int, slow_factor: float = 1.0) -> dict:
    import time

    torch.set_num_threads(1)
    transport = RayTransport(shards, owner, worker)

    def stretch(step: int, elapsed: float) -> None:  # the slow_rank drill's rule: a straggler, not a synchronisation
        time.sleep((slow_factor - 1.0) * elapsed)

    run = Replica(tiny_model(), transport, lambda m, s: share_loss(m, s, worker), before_step=stretch)
    run.run(0, STEPS)
    transport.close()
    return {"losses": run.losses, "staleness": run.stalenesses}


def run_server(sync: SyncConfig, optimizer: OptimizerConfig, slow_factor: float = 1.0) -> tuple[list, list, list]:
    """(each worker's losses, the final parameters, every applied update's record) of a run of STEPS steps."""
    params = [p.detach() for p in tiny_model().parameters()]
    shards, owner = ps_shards(f"test-{sync.consistency}-{id(sync)}", params, optimizer, sync, WORKERS, STEPS)
    results = ray.get([replica.remote(shards, owner, w, slow_factor if w == 1 else 1.0) for w in range(WORKERS)])
    parts = [iter(t) for t in ray.get([s.tensors.remote() for s in shards])]
    final = [next(parts[o]) for o in owner]
    applied = [a for s in shards for a in ray.get(s.metrics.remote())]
    for s in shards:
        ray.kill(s)
    return results, final, applied


def allreduce_reference(optimizer: OptimizerConfig) -> tuple[list[float], list[torch.Tensor]]:
    """Data parallelism's math in one process: every step the replicas' mean gradient, one optimizer step."""
    model = tiny_model()
    params = list(model.parameters())
    opt = make_optimizer([(p, p) for p in params], optimizer)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(share_loss(model, step, w) for w in range(WORKERS)) / WORKERS
        loss.backward()
        set_lr(opt, lr_at(step, optimizer, STEPS))
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in params]


ADAMW = OptimizerConfig(kind="adamw", lr=1e-2, warmup_steps=1, weight_decay=0.1)
SGD = OptimizerConfig(kind="sgd", lr=0.1, beta1=0.0, warmup_steps=0, weight_decay=0.0)


def test_bsp_follows_allreduce(ray_session):
    results, final, applied = run_server(SyncConfig(kind="parameter_server", consistency="bsp"), ADAMW)
    ref_losses, ref_final = allreduce_reference(ADAMW)
    curve = [sum(r["losses"][s] for r in results) / WORKERS for s in range(STEPS)]
    assert curve == pytest.approx(ref_losses, rel=1e-5)
    for mine, theirs in zip(final, ref_final, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert [a["step"] for a in applied] == list(range(STEPS))  # the mean, once per step
    assert all(a["worker"] == -1 and a["staleness"] == 0 for a in applied)


@slow
def test_ssp_at_staleness_0_equals_bsp_over_two_shards(ray_session):
    # SSP at s=0 against the same all-reduce math (so against BSP, which follows it): each push applied alone
    sync = SyncConfig(kind="parameter_server", consistency="ssp", staleness=0, shards=2)
    _, ssp_final, ssp_applied = run_server(sync, SGD)
    for mine, theirs in zip(ssp_final, allreduce_reference(SGD)[1], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert len(ssp_applied) == 2 * STEPS * WORKERS and all(a["staleness"] == 0 for a in ssp_applied)


@slow
@pytest.mark.parametrize(("consistency", "staleness"), [("ssp", 2), ("asp", 0)])
def test_ssp_and_asp_finish_under_a_straggler_within_their_staleness(ray_session, consistency, staleness):
    sync = SyncConfig(kind="parameter_server", consistency=consistency, staleness=staleness, shards=2)
    results, _, applied = run_server(sync, ADAMW, slow_factor=3.0)
    assert all(len(r["losses"]) == STEPS for r in results)
    assert len(applied) == 2 * STEPS * WORKERS  # every push applied on both shards
    if consistency == "ssp":
        assert max(a["staleness"] for a in applied) <= staleness
