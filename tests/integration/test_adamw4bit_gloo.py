"""adamw4bit (torchao's AdamW4bit) on real gloo ranks, as adamw8bit is checked in test_optimizers_gloo.py (slow:
its state's round trip through the checkpoint form, and its bytes, are tests/unit/test_optimizer_kinds.py): it
trains at (dp2, tp2) with ZeRO-1, quantizing tp shards and ZeRO-1 slices, checkpoints after step 3, and the
checkpoint resumes at dp1 (tp2: no ZeRO-1 slices, so the moments are cut into other blocks on load) on the
original curve; its memory plan and its measured state agree."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gloo_ranks import PlanRun, last_stage_losses, run_plans, stats_of
from helpers import SLOW, tiny_spec
from trainyard.parallel.io.checkpoint import step_dir
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.memory.estimate import estimate
from trainyard.parallel.spec import parse_spec

pytestmark = SLOW

STEPS, SAVED = 6, 3
LAYOUT = {"dp": 2, "tp": 2, "zero": 1}
MODEL = {"n_layer": 2, "n_head": 2, "d_model": 64}
"""d_model 64: the block matrices' tp shards and ZeRO-1 slices hold >= 4096 elements, which torchao quantizes."""


def plan_for(parallel: dict):
    return make_plan(parse_spec(tiny_spec(model=MODEL, steps=STEPS, optimizer={"kind": "adamw4bit"},
                                          parallel=parallel)))


def quantized_states(driver, stats) -> int:
    """How many of this rank's optimizer state tensors are 4-bit (torchao's OptimState4bit; a DTensor parameter's
    state is a DTensor around one)."""
    from trainyard.parallel.runtime.tp.local_parts import local_part

    return sum(type(local_part(t)).__name__ == "OptimState4bit" for o in driver.trainer.optimizer.optimizers
               for state in o.state.values() for t in state.values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("adamw4bit")
    original = plan_for(LAYOUT)
    resumed = plan_for({"tp": 2})
    results = run_plans([PlanRun(original, save_after=(SAVED,), root=str(root), probe=quantized_states),
                         PlanRun(resumed, resume=(str(step_dir(root, SAVED)), SAVED), probe=quantized_states)])
    return {"original": (original, results[0]), "resumed": (resumed, results[1])}


def test_adamw4bit_trains_quantizing_tp_shards_and_zero1_slices(runs):
    plan, results = runs["original"]
    losses = last_stage_losses(stats_of(results))
    assert losses[-1] < losses[0] - 0.1
    assert all(r.probe > 0 for r in results)
    # The plan counts every moment at 4 bits; torchao keeps the small tensors in fp32 (under 4096 elements, or no
    # multiple of its 128-element block: norms, biases, the odd ZeRO-1 slice), which at this tiny size are most
    # tensors (measured 2.8 x the plan: a real model's are a fraction of a percent); still under half AdamW's.
    planned = [m.optimizer for m in estimate(plan.layout, plan.config)]
    adamw = [m.optimizer for m in estimate(plan.layout, dataclasses.replace(
        plan.config, optimizer=dataclasses.replace(plan.config.optimizer, kind="adamw")))]
    measured = [rank[-1]["optimizer_bytes"] for rank in stats_of(results)]
    assert all(p < m < 0.5 * a for p, m, a in zip(planned, measured, adamw, strict=True))


def test_adamw4bit_resumes_at_another_layout_on_the_original_curve(runs):
    original = last_stage_losses(stats_of(runs["original"][1]))
    resumed_results = runs["resumed"][1]
    resumed = last_stage_losses(stats_of(resumed_results))
    assert [s["step"] for s in stats_of(resumed_results)[-1]] == [3, 4, 5]
    assert all(r.probe > 0 for r in resumed_results)
    # Not AdamW's bitwise resume: at dp1 the same moments are quantized in other blocks, and 4-bit's blocks are
    # coarse (a block whose largest first moment is negative comes back up to 11% smaller)
    np.testing.assert_allclose(resumed, original[SAVED:], rtol=2e-3)  # 3e-4 measured (adamw8bit: 5e-5)
