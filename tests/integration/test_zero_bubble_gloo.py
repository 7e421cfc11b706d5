"""Zero-bubble schedules on real gloo process groups, without Ray: zb-h1 and zbv (split backward, the V
placement) follow the single rank's losses and gradient norms within 1e-4 per step (the norm checks the
gradients themselves, which AdamW's first steps would mostly hide), alone and composed with dp, tp, sp, ZeRO-1,
recomputation (`compile: true`: below). One spawned world of 8 ranks runs the reference and every layout in turn, with
the rank driver the workers run (`parallel.runtime.driver`), so this is the numerics the service runs.

Compiled blocks under a split backward keep their linears eager (`parallel.runtime.compile`; on one rank:
tests/unit/test_compile_split_backward.py). `make test-slow` adds: zb-h1 at pp=2 with selective recompute,
compiled (the `aot_eager` backend), follows its eager twin within 1e-5, losses and every parameter after the last
step; and zbv with ZeRO-3 and zb-h1 with ZeRO-2, each against its eager
twin and its twin compiled under a schedule without split backward (interleaved-1f1b, 1f1b: blocks compiled whole),
in a world of its own (four ranks compiling cost more than `make test` has to spare).

(MoE with ep under zb-h1 is in test_moe_gloo.py, beside its single-rank MoE reference.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gloo_ranks import PlanRun, last_stage_losses, run_plans, stats_of, use_aot_eager
from helpers import SLOW_TESTS, slow, tiny_spec
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.schedule.schedule_sim import simulate
from trainyard.parallel.spec import parse_spec

LAYOUTS = {  # global batch 16 over 4 blocks
    "zb-h1 pp4 dp2 m8": ({"pp": 4, "dp": 2, "microbatches": 8, "schedule": "zb-h1"}, {}),
    # m = 4 is not a multiple of pp = 3
    "zb-h1 pp3 dp2 m4 zero1 recompute": ({"pp": 3, "dp": 2, "microbatches": 4, "schedule": "zb-h1", "zero": 1},
                                         {"activation_checkpointing": "selective"}),
    "zbv pp2 tp2": ({"pp": 2, "tp": 2, "vpp": 2, "microbatches": 4, "schedule": "zbv"}, {}),
    # gloo's collectives, not shared memory: the overlap of the weight halves with the reductions is checked below
    "zbv pp2 dp2 tp2 sp recompute": ({"pp": 2, "dp": 2, "tp": 2, "sp": True, "vpp": 2, "microbatches": 4,
                                      "schedule": "zbv", "shared_memory_reduce": False},
                                     {"activation_checkpointing": "full"}),
}
TWINS = {"zb-h1 pp2 m4 selective compiled": "zb-h1 pp2 m4 selective"}
"""A compiled layout and its eager twin (`make test-slow`: compiling under a split backward, on one rank, is
tests/unit/test_compile_split_backward.py's, in `make test`)."""
TWIN_PLANS = {"zb-h1 pp2 m4 selective compiled": ({"pp": 2, "microbatches": 4, "schedule": "zb-h1"},
                                                  {"compile": True, "activation_checkpointing": "selective"}),
              "zb-h1 pp2 m4 selective": ({"pp": 2, "microbatches": 4, "schedule": "zb-h1"},
                                         {"activation_checkpointing": "selective"})}


def plan_for(top: dict | None = None, **parallel):
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 4}, steps=2, global_batch=16, parallel=parallel,
                                          **(top or {}))))


PLANS = {"reference": plan_for(microbatches=4)} | {k: plan_for(top, **p) for k, (p, top) in LAYOUTS.items()} | (
    {k: plan_for(top, **p) for k, (p, top) in TWIN_PLANS.items()} if SLOW_TESTS else {})


def final_state(driver, stats) -> dict:
    """This rank's parameters after the last step (its local shards under ZeRO-2/3), by (dp rank, name): the same
    keys whichever pipeline rank holds the chunk (the V placement's and the loop's differ); and how many of its
    blocks' linears run eager (`torch.compiler.disable`) of how many."""
    dp = driver.plan.coords(driver.rank).dp
    params = {(dp, name): getattr(p, "_local_tensor", p).detach().clone()
              for chunk in driver.trainer.chunks for name, p in chunk.named_parameters()}
    linears = [m for chunk in driver.trainer.chunks for m in chunk.blocks.modules() if isinstance(m, torch.nn.Linear)]
    eager = sum(bool(getattr(m.forward, "_torchdynamo_disable", False)) for m in linears)
    return {"params": params, "linears": (eager, len(linears))}


def run_all(plans: dict) -> dict[str, Run]:
    """Every plan's [rank][step] stats, with each rank's `final_state` where the plan is in a twin pair; compiled
    plans on `aot_eager`."""
    twinned = {*TWINS, *TWINS.values(), *SLOW_TWINS, *(t for ts in SLOW_TWINS.values() for t in ts)}
    results = run_plans([PlanRun(plan, probe=final_state if name in twinned else None,
                                 setup=use_aot_eager if plan.config.compile else None)
                         for name, plan in plans.items()])
    return {name: Run(stats_of(r), [rank.probe for rank in r]) for name, r in zip(plans, results, strict=True)}


class Run(list):
    """One plan's [rank][step] stats, with each rank's `final_state` (None where not probed)."""

    def __init__(self, stats, final):
        super().__init__(stats)
        self.final = final

    def eager_linears(self) -> tuple[int, int]:
        """How many of the blocks' linears run eager, of how many, over the ranks."""
        return sum(f["linears"][0] for f in self.final), sum(f["linears"][1] for f in self.final)


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    """[rank][step] stats of the reference and of every layout."""
    return run_all(PLANS)


def assert_twins(run: Run, twin: Run) -> None:
    """Losses and every final parameter (every rank's shard of it) within 1e-5."""
    np.testing.assert_allclose(last_stage_losses(run), last_stage_losses(twin), rtol=1e-5)
    ours, theirs = ({k: v for rank in r.final for k, v in rank["params"].items()} for r in (run, twin))
    assert ours.keys() == theirs.keys() and ours
    for key, p in ours.items():
        torch.testing.assert_close(p, theirs[key], rtol=1e-5, atol=1e-6, msg=str(key))


@slow
@pytest.mark.parametrize("compiled", TWINS)
def test_compiled_blocks_under_a_split_backward_follow_their_eager_twin(compiled, runs):
    eager, linears = runs[compiled].eager_linears()
    assert eager == linears == 4 * 6  # gpt2: q, k, v, proj, fc, proj in each of 4 blocks
    assert_twins(runs[compiled], runs[TWINS[compiled]])


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
    expected = simulate([list(a) for a in plan.actions], plan.microbatches, plan.vpp,
                        placement=plan.schedule.placement).peak_activations
    assert [stats[0]["peak_activations"] for stats in runs[layout]] == [expected[plan.coords(r).pp]
                                                                        for r in range(plan.world_size)]


def test_the_v_puts_the_loss_on_the_first_pipeline_rank_and_reductions_start_during_backward(runs):
    zbv = runs["zbv pp2 dp2 tp2 sp recompute"]
    plan = PLANS["zbv pp2 dp2 tp2 sp recompute"]
    assert {plan.coords(r).pp for r, stats in enumerate(zbv) if stats[0]["loss"] is not None} == {0}
    # armed before each chunk's last weight-gradient half, buckets start reducing before the step's end
    assert all(stats[-1]["early_reductions"] > 0 for stats in zbv)


SLOW_LAYOUTS = {  # every one compiled but its eager twin; four ranks each
    "zbv pp2 dp2 zero3": {"pp": 2, "dp": 2, "vpp": 2, "zero": 3, "microbatches": 4, "schedule": "zbv"},
    "interleaved-1f1b pp2 dp2 zero3": {"pp": 2, "dp": 2, "vpp": 2, "zero": 3, "microbatches": 4,
                                       "schedule": "interleaved-1f1b"},
    "zb-h1 pp2 dp2 zero2": {"pp": 2, "dp": 2, "zero": 2, "microbatches": 4, "schedule": "zb-h1"},
    "1f1b pp2 dp2 zero2": {"pp": 2, "dp": 2, "zero": 2, "microbatches": 4, "schedule": "1f1b"},
}
SLOW_TWINS = {"zbv pp2 dp2 zero3 compiled": ["zbv pp2 dp2 zero3", "interleaved-1f1b pp2 dp2 zero3 compiled"],
              "zb-h1 pp2 dp2 zero2 compiled": ["zb-h1 pp2 dp2 zero2", "1f1b pp2 dp2 zero2 compiled"]}
"""A zero-bubble layout compiled, against its eager twin and its twin compiled whole under a schedule without split
backward (the blocks' linears inside the compiled regions)."""


@pytest.fixture(scope="module")
def slow_runs() -> dict[str, Run]:
    plans = {}
    for name, parallel in SLOW_LAYOUTS.items():
        plans[f"{name} compiled"] = plan_for({"compile": True}, **parallel)
        if parallel["schedule"] in ("zbv", "zb-h1"):
            plans[name] = plan_for(**parallel)
    return run_all(plans)


@slow
@pytest.mark.parametrize("compiled", SLOW_TWINS)
def test_compiled_zero_bubble_with_zero2_and_zero3_follows_its_eager_and_whole_compiled_twins(compiled, slow_runs):
    eager_twin, whole = SLOW_TWINS[compiled]
    assert slow_runs[compiled].eager_linears() == (24 * 2, 24 * 2)  # each block's on both dp ranks
    assert slow_runs[whole].eager_linears() == (0, 24 * 2)  # compiled whole: the linears inside
    for twin in (eager_twin, whole):
        assert_twins(slow_runs[compiled], slow_runs[twin])
