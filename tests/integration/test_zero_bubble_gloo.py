"""Zero-bubble schedules on real gloo process groups, without Ray: zb-h1 and zbv (split backward, the V
placement) follow the single rank's losses and gradient norms within 1e-4 per step (the norm checks the
gradients themselves, which AdamW's first steps would mostly hide), alone and composed with dp, tp, sp, ZeRO-1
and recomputation. One spawned world of 8 ranks runs the reference and every layout in turn, with the rank
driver the workers run (`parallel.runtime.driver`), so this is the numerics the service runs.

(MoE with ep under zb-h1 is in test_moe_gloo.py, beside its single-rank MoE reference.)
"""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import last_stage_losses, run_named
from helpers import tiny_spec
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.schedule_sim import simulate
from trainyard.parallel.plan.schedules import placement_of
from trainyard.parallel.spec import parse_spec

LAYOUTS = {  # global batch 16 over 4 blocks
    "zb-h1 pp4 dp2 m8": ({"pp": 4, "dp": 2, "microbatches": 8, "schedule": "zb-h1"}, {}),
    # m = 4 is not a multiple of pp = 3
    "zb-h1 pp3 dp2 m4 zero1 recompute": ({"pp": 3, "dp": 2, "microbatches": 4, "schedule": "zb-h1", "zero": 1},
                                         {"activation_checkpointing": "selective"}),
    "zbv pp2 tp2": ({"pp": 2, "tp": 2, "vpp": 2, "microbatches": 4, "schedule": "zbv"}, {}),
    "zbv pp2 dp2 tp2 sp recompute": ({"pp": 2, "dp": 2, "tp": 2, "sp": True, "vpp": 2, "microbatches": 4,
                                      "schedule": "zbv"}, {"activation_checkpointing": "full"}),
}


def plan_for(top: dict | None = None, **parallel):
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 4}, steps=2, global_batch=16, parallel=parallel,
                                          **(top or {}))))


PLANS = {"reference": plan_for(microbatches=4)} | {k: plan_for(top, **p) for k, (p, top) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[list[dict]]]:
    """[rank][step] stats of the reference and of every layout."""
    return run_named(PLANS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_bubble_layouts_follow_the_single_rank_losses_and_gradient_norms(layout, runs):
    reference = last_stage_losses(runs["reference"])
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(last_stage_losses(runs[layout]), reference, rtol=1e-4)
    norms = [[s["grad_norm"] for s in stats] for stats in (runs[layout][0], runs["reference"][0])]
    np.testing.assert_allclose(*norms, rtol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_holds_the_activations_the_simulator_counts(layout, runs):
    plan = PLANS[layout]
    expected = simulate([list(a) for a in plan.schedule], plan.microbatches, plan.vpp,
                        placement=placement_of(plan.config.parallel.schedule)).peak_activations
    assert [stats[0]["peak_activations"] for stats in runs[layout]] == [expected[plan.coords(r).pp]
                                                                        for r in range(plan.world_size)]


def test_the_v_puts_the_loss_on_the_first_pipeline_rank_and_reductions_start_during_backward(runs):
    zbv = runs["zbv pp2 dp2 tp2 sp recompute"]
    plan = PLANS["zbv pp2 dp2 tp2 sp recompute"]
    assert {plan.coords(r).pp for r, stats in enumerate(zbv) if stats[0]["loss"] is not None} == {0}
    # armed before each chunk's last weight-gradient half, buckets start reducing before the step's end
    assert all(stats[-1]["early_reductions"] > 0 for stats in zbv)
