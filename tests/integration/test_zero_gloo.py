"""ZeRO-2 and ZeRO-3 (FSDP2, `parallel.runtime.dp.fsdp`) on real gloo ranks (no Ray), with the driver the service's
workers run.

One spawned world of 8 processes runs every plan in turn: zero=2 and zero=3 at (dp2, pp2, tp2, sp, 1f1b), at
(pp2, vpp2, dp2, interleaved-1f1b) and, for MoE, at (dp2, ep2) with full recompute, zero=3 alone at (dp2),
(dp2, pp2, 1f1b) with full recompute and (dp2) with tied embeddings, and the zero-bubble schedules (zb-h1 at
zero=3, zbv at zero=2: `parallel.runtime.dp.fsdp_split`), each against the one-rank zero=0 run (which
every layout follows within 1e-4: the project's layout-equivalence rule), the interleaved ones with a
validation pass after step 1 as well; a zero=3 checkpoint resumed at zero=0 dp=1, and a zero=0 dp=1 checkpoint
resumed at zero=3 (pp2, vpp2, dp2), both continuing that curve. Every rank reports the most parameter bytes FSDP2
held gathered at once in its last step (`peak_gathered_bytes`), which the memory plan's figure must match: per
block at zero=3 (two blocks at most, and a tied embedding beside them), every chunk whole at zero=2.
"""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import RankResult, checkpointed_run, run_plans, stats_of
from helpers import REPO, tiny_spec
from trainyard.parallel.models import family_of
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.plan.reduction_bytes import reduction_bytes
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.spec import parse_spec

STEPS = 2
MODEL = {"n_layer": 4, "n_head": 2, "d_model": 32}
MOE = {"experts": 4, "top_k": 2, "every": 2}
TP = {"dp": 2, "pp": 2, "tp": 2, "sp": True, "microbatches": 2, "schedule": "1f1b"}
INTERLEAVED = {"dp": 2, "pp": 2, "vpp": 2, "microbatches": 2, "schedule": "interleaved-1f1b"}
MOE_LAYOUT = {"dp": 2, "ep": 2}
CORPUS = REPO / "examples" / "corpus.txt"


EVAL = {"eval": {"every": 1, "batches": 2}, "data": {"kind": "text", "path": str(CORPUS), "val_path": str(CORPUS)}}
"""Validation after step 1 (ZeRO-2 keeps what an evaluation gathered unless it is freed: step 2 would then
run on stale parameters)."""


def plan_for(model: dict | None = None, **top) -> Plan:
    return make_plan(parse_spec(tiny_spec(model={**MODEL, **(model or {})}, steps=STEPS, global_batch=8, **top)))


RUNS: dict[str, tuple[Plan, dict]] = {
    "reference": (plan_for(parallel={"microbatches": 2}, **EVAL), {"save": 1}),
    **{f"zero{z}-tp": (plan_for(parallel={**TP, "zero": z}), {"save": 1} if z == 3 else {}) for z in (2, 3)},
    **{f"zero{z}-interleaved": (plan_for(parallel={**INTERLEAVED, "zero": z}, **EVAL), {}) for z in (2, 3)},
    "moe-reference": (plan_for(model={"moe": MOE}, parallel={"microbatches": 2}), {}),
    **{f"moe-zero{z}": (plan_for(model={"moe": MOE}, activation_checkpointing="full",
                                 parallel={**MOE_LAYOUT, "zero": z}), {}) for z in (2, 3)},
    "zero3-dp2": (plan_for(parallel={"dp": 2, "microbatches": 2, "zero": 3}), {}),
    "zero3-pp2": (plan_for(activation_checkpointing="full",
                           parallel={"dp": 2, "pp": 2, "microbatches": 2, "schedule": "1f1b", "zero": 3}), {}),
    "tied-reference": (plan_for(model={"tie_embeddings": True}, parallel={"microbatches": 2}), {}),
    "zero3-tied": (plan_for(model={"tie_embeddings": True}, parallel={"dp": 2, "microbatches": 2, "zero": 3}), {}),
    # zero-bubble: gathered for both halves of the split backward, reduce-scattered after the weight half
    "zb-h1-zero3": (plan_for(parallel={"dp": 2, "pp": 2, "microbatches": 2, "schedule": "zb-h1", "zero": 3}), {}),
    "zbv-zero2": (plan_for(parallel={**INTERLEAVED, "schedule": "zbv", "zero": 2}), {}),
    "zero3-resumed-at-zero0-dp1": (plan_for(parallel={"microbatches": 2}), {"resume": ("zero3-tp", 1)}),
    "zero0-resumed-at-zero3": (plan_for(parallel={**INTERLEAVED, "zero": 3}), {"resume": ("reference", 1)}),
}


def gathered_peak(driver: RankDriver, stats: list[dict]) -> int:
    """The most parameter bytes FSDP2 held gathered at once in the rank's last step (0 without FSDP2)."""
    sharded = driver.trainer.sharded
    return sharded.peak_gathered_bytes if sharded is not None else 0


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[RankResult]]:
    """Every run's results, [rank]: the StepStats dicts of each step, and `gathered_peak`."""
    out = tmp_path_factory.mktemp("zero")
    ran = run_plans([checkpointed_run(out, name, plan, checkpoints, probe=gathered_peak,
                                      evaluate_after=(1,) if plan.config.eval.every else ())
                     for name, (plan, checkpoints) in RUNS.items()])
    return dict(zip(RUNS, ran, strict=True))


@pytest.fixture(scope="module")
def runs(results) -> dict[str, list[list[dict]]]:
    """Every run's StepStats dicts, [rank][step]."""
    return {name: stats_of(result) for name, result in results.items()}


def assert_follows(per_rank: list[list[dict]], reference: list[dict], first_step: int = 0) -> None:
    last_stage = [stats for stats in per_rank if stats[0]["loss"] is not None]
    assert last_stage
    for stats in last_stage:
        np.testing.assert_allclose([s["loss"] for s in stats], [s["loss"] for s in reference[first_step:]], rtol=1e-4)
    for stats in per_rank:
        np.testing.assert_allclose([s["grad_norm"] for s in stats], [s["grad_norm"] for s in reference[first_step:]],
                                   rtol=1e-4)


@pytest.mark.parametrize("name", [name for name, (_, checkpoints) in RUNS.items() if "resume" not in checkpoints])
def test_meta_construction_starts_from_the_whole_construction_bitwise(results, name):
    """Built on the meta device, sharded (tp, ep, FSDP2 per block, uneven shards included) and materialized: every
    rank's shards hold exactly the slices of the stage built whole on the CPU, tied weights one tensor."""
    for rank, result in enumerate(results[name]):
        compared, mismatches = result.start
        assert compared > 0 and mismatches == [], f"rank {rank}"


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("layout", ["tp", "interleaved"])
def test_zero2_and_zero3_follow_the_zero0_losses(runs, layout, zero):
    reference = runs["reference"][0]
    assert len(reference) == STEPS and reference[-1]["loss"] < reference[0]["loss"]
    assert_follows(runs[f"zero{zero}-{layout}"], reference)
    # the optimizer state is sharded over dp, not repeated: all ranks together hold about one copy (the
    # parameters tp replicates, wpe and the norms, are held by both tp ranks)
    total = sum(stats[-1]["optimizer_bytes"] for stats in runs[f"zero{zero}-{layout}"])
    assert total == pytest.approx(reference[-1]["optimizer_bytes"], rel=0.1)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero2_and_zero3_validate_like_zero0_and_train_on_after_it(runs, zero):
    expected = runs["reference"][0][0]["val_loss"]
    got = [stats[0]["val_loss"] for stats in runs[f"zero{zero}-interleaved"] if stats[0]["loss"] is not None]
    assert expected is not None and got
    np.testing.assert_allclose(got, expected, rtol=1e-4)  # and step 2 follows (the test above)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero2_and_zero3_follow_the_zero0_losses_with_moe_at_dp2_ep2_full_recompute(runs, zero):
    reference = runs["moe-reference"][0]
    assert_follows(runs[f"moe-zero{zero}"], reference)
    for stats in runs[f"moe-zero{zero}"]:
        assert stats[0]["moe"]["1"]["load"] == reference[0]["moe"]["1"]["load"]


@pytest.mark.parametrize("name", ["zero3-dp2", "zero3-pp2"])
def test_per_block_zero3_follows_the_zero0_losses(runs, name):
    assert_follows(runs[name], runs["reference"][0])


def test_per_block_zero3_with_tied_embeddings_follows_the_zero0_losses(runs):
    """The embedding and the head share their weight: one FSDP2 unit, run first and last in the forward."""
    assert_follows(runs["zero3-tied"], runs["tied-reference"][0])


ZERO3 = ["zero3-dp2", "zero3-pp2", "zero3-tp", "zero3-interleaved", "moe-zero3", "zero3-tied"]


@pytest.mark.parametrize("name", ZERO3)
def test_zero3_holds_at_most_two_blocks_gathered_as_the_memory_plan_says(results, name):
    plan = RUNS[name][0]
    family, m = family_of(plan.config.model), plan.config.model

    def local(layers: tuple[int, ...], first: bool = False, last: bool = False) -> int:
        return 4 * family.param_counts(m, layers, first=first, last=last, tp=plan.tp, ep=plan.ep).total

    block = max(local((i,)) for i in range(m.n_layer))  # its experts included: what FSDP2 gathers at most for it
    # tied embeddings: one unit, held from the forward's first unit to its last, beside two blocks
    bound = 2 * block + (local((), first=True, last=True) if m.tie_embeddings else 0)
    for rank, result in enumerate(results[name]):
        expected = plan.memory()[rank].gathered
        assert 0 < expected <= bound, rank
        if m.moe is None:
            assert result.probe == pytest.approx(expected, rel=0.01), rank
        else:  # the plan counts a block with all its experts, which FSDP2 gathers one at a time
            assert 0 < result.probe <= expected, rank


@pytest.mark.parametrize("name", ["zb-h1-zero3", "zbv-zero2"])
def test_zero_bubble_schedules_with_zero2_and_zero3_follow_the_zero0_losses(runs, results, name):
    """The weight half is where a unit's gradient becomes final: reduced there, not after the input half (which
    would reduce nothing, or an unfinished gradient). Gathered for both halves: a chunk at a time."""
    assert_follows(runs[name], runs["reference"][0])
    plan = RUNS[name][0]
    for rank, result in enumerate(results[name]):
        assert result.probe == pytest.approx(plan.memory()[rank].gathered, rel=0.01), rank
    # each weight half (each backward at virtual stage 0) reduce-scatters the chunk's gradients, as the plan says
    per_stage = reduction_bytes(plan)["per_stage"]
    for rank, stats in enumerate(runs[name]):
        assert stats[-1]["reduce_bytes"] == pytest.approx(per_stage[plan.coords(rank).pp]["sent"], rel=0.01), rank


@pytest.mark.parametrize("layout", ["tp", "interleaved"])
def test_zero2_holds_every_chunk_gathered_as_the_memory_plan_says(results, layout):
    plan = RUNS[f"zero2-{layout}"][0]
    for rank, result in enumerate(results[f"zero2-{layout}"]):
        assert result.probe == pytest.approx(plan.memory()[rank].gathered, rel=0.01), rank
    assert all(zero2.probe > zero3.probe for zero2, zero3 in zip(results[f"zero2-{layout}"],
                                                                  results[f"zero3-{layout}"], strict=True))


def test_a_zero3_checkpoint_resumes_at_zero0_dp1(runs):
    resumed = runs["zero3-resumed-at-zero0-dp1"]
    assert len(resumed[0]) == STEPS - 1
    assert_follows(resumed, runs["reference"][0], first_step=1)


def test_a_zero0_dp1_checkpoint_resumes_at_zero3(runs):
    resumed = runs["zero0-resumed-at-zero3"]
    assert len(resumed[0]) == STEPS - 1
    assert_follows(resumed, runs["reference"][0], first_step=1)


@pytest.mark.parametrize("zero", [2, 3])
def test_the_bytes_each_rank_reduces_per_step_are_the_plans(runs, zero):
    """Each backward of a chunk reduce-scatters its gradients: micro-batches x the local gradients."""
    plan = RUNS[f"zero{zero}-tp"][0]
    per_stage = reduction_bytes(plan)["per_stage"]
    for rank, stats in enumerate(runs[f"zero{zero}-tp"]):
        expected = per_stage[plan.coords(rank).pp]["sent"]
        assert expected > 0 and stats[-1]["reduce_bytes"] == pytest.approx(expected, rel=0.01)
