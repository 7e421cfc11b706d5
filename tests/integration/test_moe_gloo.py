"""Expert parallelism on real gloo ranks, without Ray.

The MoE layer at ep=2 (each rank hosting half the experts, tokens exchanged with all_to_all) against the
same layer on one rank fed both ranks' tokens: outputs, input gradients, expert and router gradients.
Then whole training runs with MoE blocks at layouts that mix ep with tp, sp and pipelines, dropless and with a
capacity factor, and with recomputed blocks, against the single-rank losses; every block's per-expert load
sums to the tokens routed. (tests/e2e/test_moe_http.py runs one such job through the service.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import last_stage_losses as losses
from gloo_ranks import layout_id, run_named, spawn
from helpers import tiny_spec
from trainyard.parallel.config import ModelConfig, MoEConfig
from trainyard.parallel.models import family_of
from trainyard.parallel.models.components.moe import MoEContext, MoELayer
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec

EP, B, T = 2, 3, 8


CAPACITY = {"dropless": None, "capacity1": 1.0}


def _layer_rank(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=EP)
    results = {name: _layer_check(rank, capacity_factor) for name, capacity_factor in CAPACITY.items()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _layer_check(rank: int, capacity_factor: float | None) -> dict:
    cfg = ModelConfig(n_layer=1, n_head=1, d_model=16, seq_len=T, moe=MoEConfig(
        experts=4, top_k=2, every=1, capacity_factor=capacity_factor, aux_loss_coef=0.1, z_loss_coef=0.01))
    torch.manual_seed(0)
    whole = MoELayer(cfg, range(4), family_of(cfg).feed_forward)
    hosted = range(2 * rank, 2 * rank + 2)
    mine = MoELayer(cfg, hosted, family_of(cfg).feed_forward)
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
    return {
        "output": rel(y, expected_y),
        "input grad": rel(x.grad, x_all.grad[rank * B:(rank + 1) * B]),
        "router grad": rel(router_grad, whole.router.weight.grad),
        "stats": rel(stats, whole.stats / 2),  # `whole` ran forward twice
        "expert grads": max(rel(p.grad, dict(whole.named_parameters())[n].grad)
                            for n, p in mine.named_parameters() if n.startswith("experts.")),
        "hosted": sorted(int(e) for e in mine.experts),
    }


@pytest.fixture(scope="module")
def layer_checks(tmp_path_factory) -> list[dict]:
    """Per rank: {capacity: {quantity: relative difference}}, both capacities in one spawned pair of ranks."""
    out = tmp_path_factory.mktemp("layers")
    spawn(_layer_rank, EP, str(out))
    return [torch.load(out / f"rank{rank}.pt") for rank in range(EP)]


@pytest.mark.parametrize("capacity", CAPACITY)
def test_dispatch_and_combine_at_ep2_equal_the_single_rank_layer(capacity, layer_checks):
    for rank in range(EP):
        got = dict(layer_checks[rank][capacity])
        assert got.pop("hosted") == [2 * rank, 2 * rank + 1]
        assert max(got.values()) < 1e-5, got


def plan_for(capacity_factor: float | None = None, top: dict | None = None, **parallel):
    moe = {"experts": 4, "top_k": 2, "every": 2, "capacity_factor": capacity_factor}
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 4, "moe": moe}, steps=3, global_batch=8,
                                          parallel=parallel, **(top or {}))))


TOKENS_PER_STEP = 8 * 16  # global_batch x seq_len
LAYOUTS = [
    {"dp": 2, "ep": 2},
    {"dp": 2, "ep": 2, "pp": 2, "microbatches": 2, "schedule": "1f1b"},
    # tp ranks route their own slices of each sequence, and with ep send them to other dp ranks' experts
    {"dp": 2, "ep": 2, "tp": 2, "sp": True},
    {"tp": 2, "pp": 2, "microbatches": 2, "schedule": "gpipe"},
    # a split backward: the experts' and the router's weight gradients computed apart from the exchanges
    {"dp": 2, "ep": 2, "pp": 2, "microbatches": 2, "schedule": "zb-h1"},
]


@pytest.fixture(scope="module")
def runs() -> dict[str, list[list[dict]]]:
    """[rank][step] stats of the single-rank references (dropless, capacity 1.0) and of every layout, one
    after the other in one spawned world."""
    plans = {"reference": plan_for(microbatches=2), "reference-cap1": plan_for(1.0),
             "dp2-ep2-cap1": plan_for(1.0, dp=2, ep=2),
             "recompute": plan_for(top={"activation_checkpointing": "full"}, dp=2, ep=2)}
    plans |= {layout_id(p): plan_for(**p) for p in LAYOUTS}
    return run_named(plans)


def moe_rows(per_rank: list[list[dict]]) -> list[dict]:
    """Per step, every MoE block's statistics (each rank reports its stage's blocks, summed over the stage)."""
    return [{block: layer for stats in per_rank for block, layer in stats[step]["moe"].items()}
            for step in range(len(per_rank[0]))]


@pytest.mark.parametrize("parallel", LAYOUTS, ids=layout_id)
def test_moe_layouts_follow_the_single_rank_losses(parallel, runs):
    reference, per_rank = runs["reference"][0], runs[layout_id(parallel)]
    assert reference[-1]["loss"] < reference[0]["loss"]
    last_stage = [stats for stats in per_rank if stats[0]["loss"] is not None]
    for stats in last_stage:
        np.testing.assert_allclose([s["loss"] for s in stats], [s["loss"] for s in reference], rtol=1e-4)
        # per-expert load is the stage's sum, the same whatever the layout
        assert stats[0]["moe"]["3"]["load"] == reference[0]["moe"]["3"]["load"]
    for stats in per_rank:
        np.testing.assert_allclose([s["grad_norm"] for s in stats], [s["grad_norm"] for s in reference], rtol=1e-4)


def test_with_a_capacity_factor_ep2_follows_its_own_single_rank_curve(runs):
    reference = runs["reference-cap1"]
    assert all(r["1"]["dropped_fraction"] > 0 for r in moe_rows(reference))  # capacity 1.0 does drop tokens
    np.testing.assert_allclose(losses(runs["dp2-ep2-cap1"]), losses(reference), rtol=1e-4)
    assert losses(reference) != losses(runs["reference"])


@pytest.mark.parametrize("key", ["reference", "dp2-ep2", "dp2-ep2-pp2-microbatches2-schedule1f1b"])
def test_every_moe_layers_load_sums_to_the_tokens_routed(key, runs):
    rows = moe_rows(runs[key])
    for row in rows:
        assert sorted(row) == ["1", "3"]  # blocks 1 and 3 are MoE (every=2), whichever stage holds them
        for layer in row.values():
            assert len(layer["load"]) == 4
            assert sum(layer["load"]) == TOKENS_PER_STEP * 2  # top_k = 2
            assert layer["dropped_fraction"] == 0.0
            assert 1.0 <= layer["aux_loss"] < 4.0 and layer["z_loss"] > 0
    first, reference = rows[0], moe_rows(runs["reference"])[0]
    for layer in ("1", "3"):  # the same routing in the first step, whatever the layout
        assert first[layer]["load"] == reference[layer]["load"]
        assert first[layer]["aux_loss"] == pytest.approx(reference[layer]["aux_loss"], rel=1e-4)


def test_recomputed_moe_blocks_keep_the_numbers_and_are_not_counted_twice(runs):
    rows, reference = runs["recompute"], runs["dp2-ep2"]
    np.testing.assert_allclose(losses(rows), losses(reference), rtol=1e-5)
    assert [r["3"]["load"] for r in moe_rows(rows)] == [r["3"]["load"] for r in moe_rows(reference)]
