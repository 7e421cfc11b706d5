"""Context parallelism on real gloo ranks: cp=2 follows cp=1, in one spawned world.

A tiny llama with grouped-query attention (4 query heads, 2 kv heads) trains 3 steps at cp=1 and cp=2; the losses,
gradient norms and the validation loss follow cp=1's within 1e-4, and the gradients of the first step (summed over
the cp group by the reducer) equal cp=1's within 1e-5. A mistral whose sliding window (3) is shorter than a chunk (4
tokens) follows its own cp=1 run at cp=2 over ZeRO-3 (FSDP2 shards over the dp x cp ranks) with full recompute (the
ring re-run in backward). The ring alone (`parallel.runtime.cp.ring`) against whole-sequence attention, packed
segments whose boundaries fall inside chunks and windows included: the probe on the cp=2 world. Slow (`make
test-slow`, a world of four): (dp2, cp2) over ZeRO-3, (cp2, tp2) with sp, (pp2, cp2) with tied embeddings, the
mistral at cp=4, packed chat examples at cp=4, and bf16 at cp=2 with selective recompute against bf16 at cp=1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from data_helpers import bpe_tokenizer
from gloo_ranks import PlanRun, RankResult, run_plans, stats_of
from helpers import REPO, slow, tiny_spec
from trainyard.parallel.data.prepare import PrepareOptions, prepare
from trainyard.parallel.data.sampler import step_microbatches
from trainyard.parallel.models.components.documents import attend, document_mask
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.runtime.cp.chunks import local_indices
from trainyard.parallel.runtime.cp.ring import ContextShard
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.spec import parse_spec

STEPS = 3
LLAMA = {"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 64}
MISTRAL = {**LLAMA, "family": "mistral", "sliding_window": 3}
TIED = {**LLAMA, "tie_embeddings": True}
"""At pp=2 the embedding and the head's copy sit on two stages (the tied pairs, one per cp rank)."""


def plan_for(model: dict, top: dict | None = None, **parallel) -> Plan:
    return make_plan(parse_spec(tiny_spec(model=model, steps=STEPS, global_batch=4, parallel=parallel,
                                          **(top or {}))))


def first_step_grads(driver: RankDriver) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of step 0, summed over the reduction group (the optimizer not stepped: the run's
    first step zeroes them again)."""
    trainer = driver.trainer
    ids = step_microbatches(trainer.plan, trainer.rank, 0, trainer.dataset.num_samples)
    for reducer in trainer.reducers.values():
        reducer.zero_grad()
    trainer.executor.loss_scale = trainer._loss_scale(0, ids)
    trainer._forward_backward(ids)
    for reducer in trainer.reducers.values():
        reducer.finish()
    return {name: p.grad.detach().clone() for chunk in trainer.chunks for name, p in chunk.named_parameters()}


def ring_errors(driver: RankDriver, stats: list[dict]) -> list[float] | None:
    """The ring's largest differences from whole-sequence attention (output, dq, dk, dv), causal, windowed, packed
    and both; on the cp=2 world only (None elsewhere)."""
    groups = driver.trainer.groups
    if groups.cp is None or dist.get_world_size(groups.cp) != 2 or driver.trainer.plan.dp != 1:
        return None
    me, seq = driver.trainer.coords.cp, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, seq, 8, generator=gen), *torch.randn(2, 2, 2, seq, 8, generator=gen)
    segments = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6, [0] * 11 + [1] * 5])  # boundaries inside chunks
    errors = []
    for window, packed in ((None, None), (3, None), (None, segments), (5, segments)):
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        mask = document_mask(torch.zeros(2, seq, dtype=torch.long) if packed is None else packed, window)
        expected = attend(*whole, mask)
        expected.square().sum().backward()
        idx = local_indices(seq, me, 2)
        mine = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
        got = ContextShard(groups.cp, groups.cp_ranks, me, seq, packed).attend(*mine, window)
        got.square().sum().backward()
        errors.append(float((got - expected[:, :, idx]).detach().abs().max()))
        errors += [float((m.grad - w.grad[:, :, idx]).abs().max()) for m, w in zip(mine, whole, strict=True)]
    return errors


RUNS = {
    "llama-cp1": plan_for(LLAMA, {"eval": {"every": 1, "batches": 1}}),
    "llama-cp2": plan_for(LLAMA, {"eval": {"every": 1, "batches": 1}}, cp=2),
    "mistral-cp1": plan_for(MISTRAL),
    "mistral-cp2-zero3-full": plan_for(MISTRAL, {"activation_checkpointing": "full"}, cp=2, zero=3),
}
SLOW_RUNS = {
    "llama-cp1": plan_for(LLAMA),  # no eval: held-out validation data changes what the steps train on
    "llama-dp2-cp2-zero3": plan_for(LLAMA, dp=2, cp=2, zero=3),
    "llama-cp2-tp2-sp": plan_for(LLAMA, cp=2, tp=2, sp=True),
    "tied-pp2-cp2": plan_for(TIED, cp=2, pp=2, microbatches=2),
    "tied-cp1": plan_for(TIED),
    "bf16-cp1": plan_for(LLAMA, {"precision": "bf16"}),
    "bf16-cp2-selective": plan_for(LLAMA, {"precision": "bf16", "activation_checkpointing": "selective"}, cp=2),
    "mistral-cp1": RUNS["mistral-cp1"],
    "mistral-cp4": plan_for(MISTRAL, cp=4),
}


def run_all(plans: dict[str, Plan]) -> dict[str, list[RankResult]]:
    runs = [PlanRun(plan, at_start=first_step_grads if name in ("llama-cp1", "llama-cp2") else None,
                    probe=ring_errors, evaluate_after=(STEPS,) if plan.config.eval.every else ())
            for name, plan in plans.items()]
    return dict(zip(plans, run_plans(runs), strict=True))


@pytest.fixture(scope="module")
def results() -> dict[str, list[RankResult]]:
    return run_all(RUNS)


def packed_plans(root) -> dict[str, Plan]:
    """Chat examples packed several to a row of 64 tokens (`data.packing: true`): boundaries fall anywhere in the
    chunks; at cp=1 and cp=4."""
    prepare([REPO / "examples" / "finetune.jsonl"], root / "chat", bpe_tokenizer(root / "tok"),
            PrepareOptions(chat=True), progress=False)
    spec = tiny_spec(model={**LLAMA, "vocab_size": 300, "seq_len": 64}, steps=STEPS, global_batch=4,
                     data={"kind": "tokens", "path": str(root / "chat"), "packing": True})
    return {"packed-cp1": make_plan(parse_spec(spec)),
            "packed-cp4": make_plan(parse_spec({**spec, "parallel": {"cp": 4}}))}


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory) -> dict[str, list[RankResult]]:
    return run_all({**SLOW_RUNS, **packed_plans(tmp_path_factory.mktemp("cp-packed"))})


def assert_follows(results: dict[str, list[RankResult]], name: str, reference: str, rtol: float = 1e-4) -> None:
    expected = stats_of(results[reference])[0]
    assert any(stats[0]["loss"] is not None for stats in stats_of(results[name]))
    assert len(expected) == STEPS and expected[-1]["loss"] < expected[0]["loss"]
    for stats in stats_of(results[name]):
        if stats[0]["loss"] is not None:  # a last-stage rank (at pp > 1 the others have none)
            np.testing.assert_allclose([s["loss"] for s in stats], [s["loss"] for s in expected], rtol=rtol)
        np.testing.assert_allclose([s["grad_norm"] for s in stats], [s["grad_norm"] for s in expected], rtol=rtol)


@pytest.mark.parametrize("name,reference", [("llama-cp2", "llama-cp1"), ("mistral-cp2-zero3-full", "mistral-cp1")])
def test_cp2_follows_the_single_rank_losses(results, name, reference):
    assert_follows(results, name, reference)


@slow
@pytest.mark.parametrize("name,reference", [("llama-dp2-cp2-zero3", "llama-cp1"), ("llama-cp2-tp2-sp", "llama-cp1"),
                                            ("tied-pp2-cp2", "tied-cp1"),
                                            ("mistral-cp4", "mistral-cp1"), ("packed-cp4", "packed-cp1")])
def test_dp2_cp2_zero3_cp2_tp2_cp4_and_packed_follow_the_single_rank_losses(slow_results, name, reference):
    assert_follows(slow_results, name, reference)


@slow
def test_bf16_cp2_with_selective_recompute_follows_its_bf16_single_rank_run(slow_results):
    assert_follows(slow_results, "bf16-cp2-selective", "bf16-cp1", rtol=2e-2)  # the bf16 tests' tolerance
    assert [s["loss"] for s in stats_of(slow_results["bf16-cp1"])[0]] != \
        [s["loss"] for s in stats_of(slow_results["llama-cp1"])[0]]  # bf16 really ran


def test_cp2_validation_loss_is_the_single_rank_one(results):
    expected = stats_of(results["llama-cp1"])[0][-1].get("val_loss")
    assert expected is not None and math.isfinite(expected)
    for stats in stats_of(results["llama-cp2"]):
        assert stats[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_cp2_gradients_of_one_step_equal_the_single_rank_gradients(results):
    expected = results["llama-cp1"][0].start
    for rank in results["llama-cp2"]:
        assert rank.start.keys() == expected.keys()
        for name, grad in rank.start.items():
            scale = float(expected[name].abs().max())
            assert float((grad - expected[name]).abs().max()) <= 1e-5 * max(scale, 1.0), name


def test_ring_attention_equals_whole_sequence_attention(results):
    errors = [r.probe for r in results["llama-cp2"]]
    assert all(e is not None and len(e) == 16 for e in errors)
    assert max(max(e) for e in errors) < 1e-5, errors
