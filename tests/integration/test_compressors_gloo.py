"""Top-k and QSGD gradient compression in whole runs on real gloo ranks, all plans in one spawned world (slow: the
compressors' math on two ranks runs in `make test`, tests/integration/test_grads_gloo.py, and their pure parts in
tests/unit/test_compressors.py).

Top-k at ratio 1 follows the uncompressed reduction bitwise (dp2, and with ZeRO-1); top-k at ratio 0.05 with error
feedback and 4-bit QSGD train (the loss falls) and each step sends the bytes `trainyard plan` says it sends."""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import PlanRun, last_stage_losses, run_plans, stats_of
from helpers import SLOW, tiny_spec
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.reduction_bytes import reduction_bytes
from trainyard.parallel.spec import parse_spec

pytestmark = SLOW

TOPK_FULL = {"kind": "topk", "ratio": 1.0}
TRAINING = {"steps": 8, "model": {"d_model": 64}}
"""The PowerSGD rank-2 run's size (tests/integration/test_grads_gloo.py): long enough for the loss to fall."""


def plan_for(steps=3, model=None, **spec):
    return make_plan(parse_spec(tiny_spec(steps=steps, **({"model": model} if model else {}), **spec)))


@pytest.fixture(scope="module")
def runs() -> dict:
    plans = {
        "dp2": plan_for(parallel={"dp": 2}),
        "dp2-topk-full": plan_for(parallel={"dp": 2, "grad_compression": TOPK_FULL}),
        "dp2-zero1": plan_for(parallel={"dp": 2, "zero": 1}),
        "dp2-zero1-topk-full": plan_for(parallel={"dp": 2, "zero": 1, "grad_compression": TOPK_FULL}),
        "dp2-topk": plan_for(**TRAINING, parallel={"dp": 2, "grad_compression": {
            "kind": "topk", "ratio": 0.05, "warmup_steps": 1}}),
        "dp2-qsgd": plan_for(**TRAINING, parallel={"dp": 2, "grad_compression": {"kind": "qsgd", "levels": 7}}),
    }
    results = run_plans([PlanRun(plan) for plan in plans.values()])
    return {name: (plan, stats_of(result)) for (name, plan), result in zip(plans.items(), results, strict=True)}


@pytest.mark.parametrize("name", ["dp2", "dp2-zero1"])
def test_topk_at_ratio_1_is_the_uncompressed_reduction_bitwise(runs, name):
    reference, got = runs[name][1], runs[f"{name}-topk-full"][1]
    np.testing.assert_array_equal(last_stage_losses(got), last_stage_losses(reference))
    for ref_rank, rank in zip(reference, got, strict=True):
        assert [s["grad_norm"] for s in rank] == [s["grad_norm"] for s in ref_rank]
        # every element as an (index, value) pair: twice the plain payload on the matrices
        assert all(s["reduce_bytes"] > r["reduce_bytes"] for s, r in zip(rank, ref_rank, strict=True))


@pytest.mark.parametrize("name,fraction", [("dp2-topk", 0.12), ("dp2-qsgd", 0.14)])
def test_topk_and_qsgd_train_on_the_bytes_the_plan_counts(runs, name, fraction):
    plan, stats = runs[name]
    losses = last_stage_losses(stats)
    assert losses[-1] < losses[0] - 0.1
    planned = reduction_bytes(plan)["per_stage"][0]
    sent = [s["reduce_bytes"] for s in stats[0]]
    if name == "dp2-topk":  # its first step is the warm-up: uncompressed
        assert sent[0] == planned["uncompressed"]
        sent = sent[1:]
    assert set(sent) == {planned["sent"]} and planned["sent"] < fraction * planned["uncompressed"]
    for rank in stats:  # every rank sends the same payload each step
        assert [s["reduce_bytes"] for s in rank] == [s["reduce_bytes"] for s in stats[0]]
