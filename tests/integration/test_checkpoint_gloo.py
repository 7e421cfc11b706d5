"""Sharded checkpoints on real gloo ranks, without Ray: a job checkpoints after step 3 (in the background for the
dense one), and a run resumed from it at another layout follows the original's losses within 1e-4 per step,
dense (dp=2 x tp=2 to pp=2) and MoE (dp=2 x ep=2 to one rank). The writing and the resumed runs are plans of
one spawned world, in turn. (Resuming at the same layout, bit-identically, through the service:
tests/e2e/test_checkpoint_http.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import PlanRun, last_stage_losses, run_plans, stats_of
from helpers import tiny_spec
from trainyard.parallel.io.checkpoint import step_dir
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec

STEPS = 6
MOE = {"experts": 4, "top_k": 2, "every": 2}


def plan_for(parallel: dict, moe: bool = False):
    model = {"n_layer": 4, **({"moe": MOE} if moe else {})}
    return make_plan(parse_spec(tiny_spec(model=model, global_batch=8, steps=STEPS, parallel=parallel)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[list[dict]]]:
    root = tmp_path_factory.mktemp("checkpoints")
    dense, moe = root / "dense", root / "moe"
    plans = [
        ("dense", PlanRun(plan_for({"dp": 2, "tp": 2}), save_after=(3,), root=str(dense), background=True)),
        ("moe", PlanRun(plan_for({"dp": 2, "ep": 2}, moe=True), save_after=(3,), root=str(moe))),
        ("dense-pp2", PlanRun(plan_for({"pp": 2, "microbatches": 2}), resume=(str(step_dir(dense, 3)), 3))),
        ("moe-one-rank", PlanRun(plan_for({}, moe=True), resume=(str(step_dir(moe, 3)), 3))),
    ]
    results = run_plans([run for _, run in plans])
    return {key: stats_of(r) for (key, _), r in zip(plans, results, strict=True)}


@pytest.mark.parametrize(("original", "resumed"), [("dense", "dense-pp2"), ("moe", "moe-one-rank")])
def test_a_run_resumed_at_another_layout_follows_the_original_curve(runs, original, resumed):
    assert [s["step"] for s in runs[resumed][-1]] == [3, 4, 5]
    np.testing.assert_allclose(last_stage_losses(runs[resumed]), last_stage_losses(runs[original])[3:], rtol=1e-4)
