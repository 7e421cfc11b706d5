"""Tensor and sequence parallelism on real gloo ranks, without Ray.

Each sharded piece against the same module unsharded (forward and gradients, see tp_layer_checks), then
whole training runs with tp=2, alone and composed with sp, dp and pipelines, against dp=pp=tp=1's losses.
"""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import layout_id, run_named
from helpers import tiny_spec
from tp_layer_checks import MAX_NORM, Results, run_layer_checks
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec

TOL = 1e-5  # largest difference relative to the tensor's largest value, fp32
SP = pytest.mark.parametrize("tag", ["no-sp", "sp"])


@pytest.fixture(scope="module")
def layers(tmp_path_factory) -> list[Results]:
    return run_layer_checks(tmp_path_factory.mktemp("layers"))


def worst(layers: list[Results], check: str) -> dict[str, float]:
    """Each quantity of one check, the worst over the ranks."""
    return {k: max(rank[check][k] for rank in layers) for k in layers[0][check]}


def assert_close(errors: dict[str, float], *facts: str) -> None:
    too_far = {k: v for k, v in errors.items() if k not in facts and v > TOL}
    assert not too_far, too_far


@SP
def test_attention_split_by_heads_matches_the_unsharded_attention(layers, tag):
    got = worst(layers, f"attn {tag}")
    facts = [f"local heads {n}" for n in "qkv"]
    assert [got[f] for f in facts] == [2, 2, 2]  # n_head=4 over tp=2: q, k and v each keep two whole heads
    assert_close(got, *facts)


@SP
def test_mlp_column_then_row_parallel_matches_the_unsharded_mlp(layers, tag):
    assert_close(worst(layers, f"mlp {tag}"))


@SP
def test_block_with_its_norms_matches_the_unsharded_block(layers, tag):
    # With sp the norms see only this rank's tokens: their gradients must come out summed over tp.
    assert_close(worst(layers, f"block {tag}"))


@SP
def test_vocab_parallel_embedding_matches_the_unsharded_embedding(layers, tag):
    got = worst(layers, f"embedding {tag}")
    assert got["local vocab rows"] == 128
    assert_close(got, "local vocab rows")


@SP
def test_vocab_parallel_loss_matches_the_full_cross_entropy(layers, tag):
    got = worst(layers, f"loss {tag}")
    assert got["local logits width"] == 512  # no rank ever holds all 1024 logits of a token
    assert_close(got, "local logits width", "saved bytes ratio")


@SP
def test_vocab_parallel_loss_keeps_about_half_the_memory_for_backward_at_tp2(layers, tag):
    assert worst(layers, f"loss {tag}")["saved bytes ratio"] < 0.6


def test_tp2_init_gathers_to_exactly_the_tp1_weights(layers):
    got = worst(layers, "init")
    assert got["equal"] == got["parameters"] == got["expected parameters"]
    assert got["sharded"] > 0


@SP
def test_clipped_gradient_norm_at_tp2_equals_tp1(layers, tag):
    got = worst(layers, f"model {tag}")
    assert got["unclipped norm"] > MAX_NORM  # so clipping scales every gradient by the (shared) norm
    assert got["grads in buckets"] == 1.0
    assert_close(got, "unclipped norm", "grads in buckets")


def test_tied_embeddings_stay_tied_when_sharded(layers):
    got = worst(layers, "tied")
    assert got["tied"] == 1.0
    assert_close(got, "tied", "unclipped norm", "grads in buckets")


def plan_for(**parallel):
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 4}, steps=3, global_batch=8, parallel=parallel)))


LAYOUTS = [
    {"tp": 2, "microbatches": 2},
    {"tp": 2, "sp": True, "microbatches": 2},
    {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2, "schedule": "1f1b"},
    # With sp the stages exchange sequence slices: (micro_batch, seq_len / tp, d_model) per rank.
    {"pp": 2, "vpp": 2, "tp": 2, "sp": True, "microbatches": 2, "schedule": "interleaved-1f1b"},
]


@pytest.fixture(scope="module")
def runs() -> dict[str, list[list[dict]]]:
    """[rank][step] stats of the single-rank reference and of every layout, from one spawned world."""
    plans = {"reference": plan_for(microbatches=2)} | {layout_id(p): plan_for(**p) for p in LAYOUTS}
    return run_named(plans)


@pytest.fixture(scope="module")
def reference(runs) -> list[dict]:
    stats = runs["reference"][0]
    # Clipping acts in every step, so the runs below also check the norm summed over tp shards.
    assert min(s["grad_norm"] for s in stats) > plan_for().config.optimizer.grad_clip
    return stats


@pytest.mark.parametrize("parallel", LAYOUTS, ids=layout_id)
def test_tensor_parallel_layouts_follow_the_single_rank_losses(parallel, reference, runs):
    per_rank = runs[layout_id(parallel)]
    last_stage = [stats for stats in per_rank if stats[0]["loss"] is not None]
    assert len(last_stage) == parallel.get("dp", 1) * parallel["tp"]  # every tp rank of the last stage has it
    for stats in last_stage:
        np.testing.assert_allclose([s["loss"] for s in stats], [s["loss"] for s in reference], rtol=1e-4)
    for stats in per_rank:
        np.testing.assert_allclose([s["grad_norm"] for s in stats], [s["grad_norm"] for s in reference], rtol=1e-4)
