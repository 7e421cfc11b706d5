"""The llama family at every kind of layout on real gloo ranks (no Ray): each follows its one-rank run.

One spawned world of 8 processes runs every plan in turn (`gloo_ranks.run_plans`: a plan of fewer ranks
leaves the others waiting for the next), so the processes start once: llama with grouped-query attention
(n_head 4, n_kv_head 2, so tp=2 keeps one kv head per rank) at (dp2, pp2, tp2, 1f1b) and at
(pp2, vpp2, tp2, sp, interleaved-1f1b),
the second resuming from the first's checkpoint (another layout); llama MoE at (dp2, ep2) with full
recompute; and bf16 with ZeRO-1 and selective recompute at (dp2, tp2) against the one-rank bf16 run with
selective recompute.
"""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import RankResult, checkpointed_run, run_plans, stats_of
from helpers import tiny_spec
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.spec import parse_spec

STEPS = 3
LLAMA = {"family": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 64,
         "rope_theta": 500000.0}
MOE = {"experts": 4, "top_k": 2, "every": 2}


def plan_for(model: dict | None = None, **top) -> Plan:
    spec = tiny_spec(model={**LLAMA, **(model or {})}, steps=STEPS, global_batch=8, **top)
    return make_plan(parse_spec(spec))


RUNS: dict[str, tuple[Plan, dict]] = {
    "reference": (plan_for(parallel={"microbatches": 2}), {}),
    "dp2-pp2-tp2-1f1b": (plan_for(parallel={"dp": 2, "pp": 2, "tp": 2, "microbatches": 2, "schedule": "1f1b"}),
                         {"save": 2}),
    "pp2-vpp2-tp2-sp-interleaved": (plan_for(parallel={"pp": 2, "vpp": 2, "tp": 2, "sp": True, "microbatches": 2,
                                                       "schedule": "interleaved-1f1b"}), {}),
    "resumed-pp2-vpp2-tp2-sp": (plan_for(parallel={"pp": 2, "vpp": 2, "tp": 2, "sp": True, "microbatches": 2,
                                                   "schedule": "interleaved-1f1b"}),
                                {"resume": ("dp2-pp2-tp2-1f1b", 2)}),
    "moe-reference": (plan_for(model={"moe": MOE}, parallel={"microbatches": 2}), {}),
    "moe-dp2-ep2-full-recompute": (plan_for(model={"moe": MOE}, activation_checkpointing="full",
                                            parallel={"dp": 2, "ep": 2}), {}),
    "bf16-reference": (plan_for(precision="bf16", activation_checkpointing="selective"), {}),
    "bf16-dp2-tp2-zero1-selective": (plan_for(precision="bf16", activation_checkpointing="selective",
                                              parallel={"dp": 2, "tp": 2, "zero": 1}), {}),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[RankResult]]:
    """Every run's results, [rank]: its StepStats dicts, and `check_initial` before the first step."""
    out = tmp_path_factory.mktemp("llama")
    ran = run_plans([checkpointed_run(out, name, plan, checkpoints) for name, (plan, checkpoints) in RUNS.items()])
    return dict(zip(RUNS, ran, strict=True))


@pytest.fixture(scope="module")
def runs(results) -> dict[str, list[list[dict]]]:
    """Every run's StepStats dicts, [rank][step]."""
    return {name: stats_of(result) for name, result in results.items()}


@pytest.mark.parametrize("name", [name for name, (_, checkpoints) in RUNS.items() if "resume" not in checkpoints])
def test_meta_construction_starts_from_the_whole_construction_bitwise(results, name):
    """Rotary frequencies (buffers, recomputed after `to_empty`), GQA's kv heads over tp, experts over ep: every
    rank's parameters and buffers are the slices of the stage built whole on the CPU."""
    for rank, result in enumerate(results[name]):
        compared, mismatches = result.start
        assert compared > 0 and mismatches == [], f"rank {rank}"


def last_stage(per_rank: list[list[dict]]) -> list[list[dict]]:
    return [stats for stats in per_rank if stats[0]["loss"] is not None]


def assert_follows(per_rank: list[list[dict]], reference: list[dict], rtol: float, first_step: int = 0) -> None:
    for stats in last_stage(per_rank):
        np.testing.assert_allclose([s["loss"] for s in stats], [s["loss"] for s in reference[first_step:]],
                                   rtol=rtol)
    for stats in per_rank:
        np.testing.assert_allclose([s["grad_norm"] for s in stats],
                                   [s["grad_norm"] for s in reference[first_step:]], rtol=rtol)


@pytest.mark.parametrize("layout", ["dp2-pp2-tp2-1f1b", "pp2-vpp2-tp2-sp-interleaved"])
def test_llama_gqa_layouts_follow_the_single_rank_losses(runs, layout):
    reference = runs["reference"][0]
    assert len(reference) == STEPS and reference[-1]["loss"] < reference[0]["loss"]
    # every tp rank (of every dp replica) of the last stage has the loss
    assert len(last_stage(runs[layout])) == {"dp2-pp2-tp2-1f1b": 4, "pp2-vpp2-tp2-sp-interleaved": 2}[layout]
    assert_follows(runs[layout], reference, rtol=1e-4)


def test_llama_resumed_at_another_layout_continues_the_single_rank_curve(runs):
    resumed = runs["resumed-pp2-vpp2-tp2-sp"]
    assert len(resumed[0]) == STEPS - 2
    assert_follows(resumed, runs["reference"][0], rtol=1e-4, first_step=2)


def test_llama_moe_at_dp2_ep2_with_full_recompute_follows_the_single_rank_losses(runs):
    reference = runs["moe-reference"][0]
    assert_follows(runs["moe-dp2-ep2-full-recompute"], reference, rtol=1e-4)
    for stats in last_stage(runs["moe-dp2-ep2-full-recompute"]):
        assert stats[0]["moe"]["1"]["load"] == reference[0]["moe"]["1"]["load"]  # the stage's tokens per expert


def test_llama_bf16_zero1_selective_follows_its_single_rank_bf16_run(runs):
    reference = runs["bf16-reference"][0]
    # bf16's rounding differs with the layout (sums split over tp and dp): the bf16 tests' tolerance
    assert_follows(runs["bf16-dp2-tp2-zero1-selective"], reference, rtol=2e-2)
    fp32 = [s["loss"] for s in runs["reference"][0]]
    assert [s["loss"] for s in reference] != fp32  # bf16 really ran
    # ZeRO-1: each dp rank keeps the optimizer state of about half its parameters
    ratio = runs["bf16-dp2-tp2-zero1-selective"][0][-1]["optimizer_bytes"] / reference[-1]["optimizer_bytes"]
    assert 0.2 < ratio < 0.3, ratio  # half over dp2, and half again over tp2
