"""Speed and memory settings on real gloo ranks, without Ray: each follows the plain run's losses, and each
shows its effect in what the ranks measure (activation bytes, optimizer bytes, reductions overlapped)."""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import run_ranks
from helpers import tiny_spec

from api.spec import parse_spec
from parallel.plan import make_plan

LAYOUT = {"dp": 2, "pp": 2, "microbatches": 2}


def plan_for(parallel: dict, **top):
    spec = tiny_spec(model={"n_layer": 4, "moe": {"experts": 4, "every": 2}}, steps=4, global_batch=8,
                     parallel=parallel, **top)
    return make_plan(parse_spec(spec))


def losses(per_rank: list[list[dict]]) -> list[float]:
    return [s["loss"] for s in next(stats for stats in per_rank if stats[0]["loss"] is not None)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[list[dict]]:
    return run_ranks(plan_for(LAYOUT), tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_numbers_and_lowers_the_measured_peak(mode, plain, tmp_path):
    per_rank = run_ranks(plan_for(LAYOUT, activation_checkpointing=mode), tmp_path)
    np.testing.assert_allclose(losses(per_rank), losses(plain), rtol=1e-5)
    for rank, stats in enumerate(per_rank):
        assert stats[-1]["peak_activation_bytes"] < 0.9 * plain[rank][-1]["peak_activation_bytes"], rank
    # the MoE statistics are not counted a second time when a block is recomputed in backward
    assert per_rank[-1][0]["moe"] == plain[-1][0]["moe"]


def test_zero1_holds_half_the_optimizer_state_and_keeps_the_numbers(plain, tmp_path):
    per_rank = run_ranks(plan_for({**LAYOUT, "zero": 1}), tmp_path)
    np.testing.assert_allclose(losses(per_rank), losses(plain), rtol=1e-5)
    for rank, stats in enumerate(per_rank):
        ratio = stats[-1]["optimizer_bytes"] / plain[rank][-1]["optimizer_bytes"]
        assert 0.45 < ratio < 0.6, (rank, ratio)  # half, plus the pieces at slice edges and padding


def test_reductions_start_during_backward_unless_overlap_is_off(plain, tmp_path):
    assert all(stats[-1]["early_reductions"] > 0 for stats in plain)
    per_rank = run_ranks(plan_for({**LAYOUT, "overlap_reduce": False}), tmp_path)
    assert all(stats[-1]["early_reductions"] == 0 for stats in per_rank)
    assert losses(per_rank) == losses(plain)  # the same sums in the same order


def test_bf16_follows_fp32_and_bf16_reduction_too(plain, tmp_path):
    per_rank = run_ranks(plan_for({**LAYOUT, "reduce_dtype": "bf16"}, precision="bf16"), tmp_path)
    got, expected = losses(per_rank), losses(plain)
    np.testing.assert_allclose(got[2:], expected[2:], rtol=2e-2)  # after warm-up
    assert got != expected  # it did run in bf16
