"""ZeRO-1 and overlapped gradient reduction on real gloo ranks, without Ray, in an MoE pipeline: each follows
the plain run's losses and shows its effect in what the ranks measure (optimizer bytes, reductions started
during backward). bf16 and activation checkpointing are checked through the service
(tests/e2e/test_performance_http.py)."""

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
