"""Expert parallelism on real gloo ranks, without Ray.

The MoE layer at ep=2 (each rank hosting half the experts, tokens exchanged with all_to_all) against the
same layer on one rank fed both ranks' tokens: outputs, input gradients, expert and router gradients.
Then whole training runs with MoE blocks at layouts that mix ep with tp, sp and pipelines, against the
single-rank losses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks, spawn
from helpers import tiny_spec

from api.spec import parse_spec
from parallel.config import ModelConfig, MoEConfig
from parallel.models import family_of
from parallel.moe import MoEContext, MoELayer
from parallel.plan import make_plan

EP, B, T = 2, 3, 8


def _layer_rank(rank: int, port: int, capacity_factor: float | None, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=EP)
    cfg = ModelConfig(n_layer=1, n_head=1, d_model=16, seq_len=T, moe=MoEConfig(
        experts=4, top_k=2, every=1, capacity_factor=capacity_factor, aux_loss_coef=0.1, z_loss_coef=0.01))
    torch.manual_seed(0)
    whole = MoELayer(cfg, range(4), family_of(cfg).expert)
    hosted = range(2 * rank, 2 * rank + 2)
    mine = MoELayer(cfg, hosted, family_of(cfg).expert)
    mine.load_state_dict({k: v for k, v in whole.state_dict().items() if k in mine.state_dict()})
    whole.context = MoEContext(sequences_per_step=EP * B)
    mine.context = MoEContext(sequences_per_step=EP * B, ep_group=dist.group.WORLD)

    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(EP * B, T, 16, generator=gen)  # both ranks' tokens; this rank holds its B sequences
    probe = torch.randn(EP * B, T, 16, generator=gen)
    x_all.requires_grad_()
    (whole(x_all) * probe).sum().backward()
    x = x_all.detach()[rank * B:(rank + 1) * B].clone().requires_grad_()
    y = mine(x)
    (y * probe[rank * B:(rank + 1) * B]).sum().backward()

    router_grad = mine.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # each rank routed its own tokens: the router's gradient is a sum over ranks
    stats = mine.stats.clone()
    dist.all_reduce(stats)

    @torch.no_grad()
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))

    with torch.no_grad():
        expected_y = whole(x_all)[rank * B:(rank + 1) * B]
    results = {
        "output": rel(y, expected_y),
        "input grad": rel(x.grad, x_all.grad[rank * B:(rank + 1) * B]),
        "router grad": rel(router_grad, whole.router.weight.grad),
        "stats": rel(stats, whole.stats / 2),  # `whole` ran forward twice
        "expert grads": max(rel(p.grad, dict(whole.named_parameters())[n].grad)
                            for n, p in mine.named_parameters() if n.startswith("experts.")),
        "hosted": sorted(int(e) for e in mine.experts),
    }
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity1"])
def test_dispatch_and_combine_at_ep2_equal_the_single_rank_layer(capacity_factor, tmp_path):
    spawn(_layer_rank, EP, capacity_factor, str(tmp_path))
    for rank in range(EP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.pop("hosted") == [2 * rank, 2 * rank + 1]
        assert max(got.values()) < 1e-5, got


def plan_for(capacity_factor: float | None = None, **parallel):
    moe = {"experts": 4, "top_k": 2, "every": 2, "capacity_factor": capacity_factor}
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 4, "moe": moe}, steps=3, global_batch=8,
                                          parallel=parallel)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return run_ranks(plan_for(microbatches=2), tmp_path_factory.mktemp("ref"))[0]


@pytest.mark.parametrize("parallel", [
    # tp ranks route their own slices of each sequence, and with ep send them to other dp ranks' experts
    {"dp": 2, "ep": 2, "tp": 2, "sp": True},
    {"tp": 2, "pp": 2, "microbatches": 2, "schedule": "gpipe"},
], ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_moe_layouts_follow_the_single_rank_losses(parallel, reference, tmp_path):
    per_rank = run_ranks(plan_for(**parallel), tmp_path)
    last_stage = [stats for stats in per_rank if stats[0]["loss"] is not None]
    for stats in last_stage:
        np.testing.assert_allclose([s["loss"] for s in stats], [s["loss"] for s in reference], rtol=1e-4)
        # per-expert load is the stage's sum, the same whatever the layout
        assert stats[0]["moe"]["3"]["load"] == reference[0]["moe"]["3"]["load"]
    for stats in per_rank:
        np.testing.assert_allclose([s["grad_norm"] for s in stats], [s["grad_norm"] for s in reference], rtol=1e-4)
