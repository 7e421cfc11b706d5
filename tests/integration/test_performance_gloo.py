"""Speed and memory settings on real gloo ranks, without Ray: each follows the plain run and shows its effect in
what the ranks measure.

- ZeRO-1 and overlapped gradient reduction in an MoE pipeline (dp=2, pp=2): losses within 1e-5, half the optimizer
  state; with gloo's collectives (shared_memory_reduce off) reductions start during backward unless overlap is off,
  and the sums through shared memory (the default here: every rank on one host) start none; all three bit-identical.
- Activation checkpointing (full, selective) and ZeRO-1 at a (dp=2, pp=2) and a (dp=2, tp=2) layout follow the
  plain run within 1e-5, bf16 within 2e-2 after warm-up; checkpointing lowers the measured activation peak.
Every run is one plan of one spawned world (tests/e2e/test_performance_http.py runs one job with these
settings through the service)."""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import last_stage_losses, run_named
from helpers import tiny_spec
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec

LAYOUT = {"dp": 2, "pp": 2, "microbatches": 2}
GLOO = {**LAYOUT, "shared_memory_reduce": False}
MOE_VARIANTS = {"plain": LAYOUT, "zero1": {**LAYOUT, "zero": 1}, "gloo": GLOO,
                "gloo-no-overlap": {**GLOO, "overlap_reduce": False}}
LAYOUTS = {"dp2-pp2": {"dp": 2, "pp": 2, "microbatches": 2}, "dp2-tp2": {"dp": 2, "tp": 2}}
SETTINGS = {
    "plain": {},
    "full": {"activation_checkpointing": "full"},
    "selective": {"activation_checkpointing": "selective"},
    "zero1": {"parallel": {"zero": 1}},
    "bf16": {"precision": "bf16"},
}


def moe_plan(parallel: dict):
    spec = tiny_spec(model={"n_layer": 4, "moe": {"experts": 4, "every": 2}}, steps=4, global_batch=8,
                     parallel=parallel)
    return make_plan(parse_spec(spec))


def dense_plan(layout: str, setting: str):
    top = dict(SETTINGS[setting])
    parallel = {**LAYOUTS[layout], **top.pop("parallel", {})}
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 4}, global_batch=8, steps=5, parallel=parallel, **top)))


@pytest.fixture(scope="module")
def runs() -> dict[object, list[list[dict]]]:
    """[rank][step] stats of every variant, one after the other in one spawned world."""
    plans = {("moe", name): moe_plan(parallel) for name, parallel in MOE_VARIANTS.items()}
    plans |= {(layout, setting): dense_plan(layout, setting) for layout in LAYOUTS for setting in SETTINGS}
    return run_named(plans)


def test_zero1_holds_half_the_optimizer_state_and_keeps_the_numbers(runs):
    plain, per_rank = runs["moe", "plain"], runs["moe", "zero1"]
    np.testing.assert_allclose(last_stage_losses(per_rank), last_stage_losses(plain), rtol=1e-5)
    for rank, stats in enumerate(per_rank):
        ratio = stats[-1]["optimizer_bytes"] / plain[rank][-1]["optimizer_bytes"]
        assert 0.45 < ratio < 0.6, (rank, ratio)  # half, plus the pieces at slice edges and padding


def test_gloo_reductions_start_during_backward_unless_overlap_is_off_and_shared_memory_sums_alike(runs):
    overlapped, after, shared = runs["moe", "gloo"], runs["moe", "gloo-no-overlap"], runs["moe", "plain"]
    assert all(stats[-1]["early_reductions"] > 0 for stats in overlapped)
    assert all(stats[-1]["early_reductions"] == 0 for stats in after + shared)
    # two ranks: every sum is a + b, whoever adds
    assert last_stage_losses(after) == last_stage_losses(overlapped) == last_stage_losses(shared)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("setting", ["full", "selective", "zero1"])
def test_setting_follows_the_plain_run(runs, layout, setting):
    np.testing.assert_allclose(last_stage_losses(runs[layout, setting]), last_stage_losses(runs[layout, "plain"]),
                               rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_follows_fp32_after_warm_up(runs, layout):
    bf16, fp32 = last_stage_losses(runs[layout, "bf16"]), last_stage_losses(runs[layout, "plain"])
    np.testing.assert_allclose(bf16[2:], fp32[2:], rtol=2e-2)
    assert bf16 != fp32


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpointing_lowers_the_measured_activation_peak(runs, layout):
    peak = {s: max(stats[-1]["peak_activation_bytes"] for stats in runs[layout, s])
            for s in ("plain", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["plain"], peak
