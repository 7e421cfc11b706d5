"""Data and pipeline parallelism on real gloo process groups, without Ray: every layout follows the single
rank's losses within 1e-4 per step. One spawned world runs the references and every layout in turn.

Two families: a batch of 8 over 4 blocks (dp alone, and each schedule at pp=2), and a batch of 12 over 8 blocks
cut into 3 and 6 micro-batches, neither a multiple of pp=2 or pp=4 (with dp, and interleaved at pp=4)."""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import last_stage_losses, run_named
from helpers import tiny_spec
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec

EIGHT = {  # global batch 8, 4 blocks
    "dp2": {"dp": 2},
    "dp4": {"dp": 4},
    "dp2-microbatches2": {"dp": 2, "microbatches": 2},
    "pp2-microbatches4-schedule1f1b": {"pp": 2, "microbatches": 4, "schedule": "1f1b"},
    "pp2-microbatches4-schedulegpipe": {"pp": 2, "microbatches": 4, "schedule": "gpipe"},
    "pp2-vpp2-microbatches4-scheduleinterleaved-1f1b": {"pp": 2, "vpp": 2, "microbatches": 4,
                                                         "schedule": "interleaved-1f1b"},
}
TWELVE = {  # global batch 12, 8 blocks
    "pp2-microbatches3-schedulegpipe": {"pp": 2, "microbatches": 3, "schedule": "gpipe"},
    "pp2-microbatches3-schedule1f1b": {"pp": 2, "microbatches": 3, "schedule": "1f1b"},
    "pp2-dp2-microbatches3-schedulegpipe": {"pp": 2, "dp": 2, "microbatches": 3, "schedule": "gpipe"},
    "pp2-dp2-microbatches3-schedule1f1b": {"pp": 2, "dp": 2, "microbatches": 3, "schedule": "1f1b"},
    "pp4-vpp2-microbatches6-schedulegpipe": {"pp": 4, "vpp": 2, "microbatches": 6, "schedule": "gpipe"},
    "pp4-vpp2-microbatches6-scheduleinterleaved-1f1b": {"pp": 4, "vpp": 2, "microbatches": 6,
                                                         "schedule": "interleaved-1f1b"},
}


def plan_for(**parallel):
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 4}, steps=3, global_batch=8, parallel=parallel)))


def plan12_for(**parallel):
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 8}, steps=3, global_batch=12, parallel=parallel)))


@pytest.fixture(scope="module")
def runs() -> dict[str, list[list[dict]]]:
    """[rank][step] stats of both references and of every layout."""
    plans = {"reference": plan_for(dp=1, pp=1, microbatches=4), "reference12": plan12_for()}
    plans |= {k: plan_for(**p) for k, p in EIGHT.items()} | {k: plan12_for(**p) for k, p in TWELVE.items()}
    return run_named(plans)


@pytest.mark.parametrize("layout", EIGHT)
def test_layouts_match_the_single_rank_losses(layout, runs):
    reference = last_stage_losses(runs["reference"])
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(last_stage_losses(runs[layout]), reference, rtol=1e-4)


@pytest.mark.parametrize("layout", TWELVE)
def test_uneven_micro_batches_match_the_single_rank_losses(layout, runs):
    reference = last_stage_losses(runs["reference12"])
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(last_stage_losses(runs[layout]), reference, rtol=1e-4)


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_pp(runs):
    gpipe = runs["pp2-microbatches4-schedulegpipe"]
    one_f_one_b = runs["pp2-microbatches4-schedule1f1b"]
    assert [r[0]["peak_activations"] for r in gpipe] == [4, 4]
    assert [r[0]["peak_activations"] for r in one_f_one_b] == [2, 1]
    assert one_f_one_b[0][0]["peak_activation_bytes"] < gpipe[0][0]["peak_activation_bytes"]
    # with 3 micro-batches (not a multiple of pp) too
    assert [r[0]["peak_activations"] for r in runs["pp2-microbatches3-schedulegpipe"]] == [3, 3]
    assert [r[0]["peak_activations"] for r in runs["pp2-microbatches3-schedule1f1b"]] == [2, 1]
