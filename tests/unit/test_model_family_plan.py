"""Model families in the plan: a llama JobSpec through spec validation and `make_plan`, the family's rules
(each a RuleError naming its field), its exact parameter counts, its activation estimate against the
pipeline's saved-tensor meter, and FLOPs per token."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_spec
from trainyard.cli.offline import format_plan
from trainyard.parallel.models import FAMILIES, family_of
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.plan.memory.estimate import param_counts
from trainyard.parallel.plan.present import describe
from trainyard.parallel.runtime.pipeline.pipeline import _SavedTensorMeter
from trainyard.parallel.runtime.step.step_inputs import autocast_context
from trainyard.parallel.spec import SpecError, parse_spec

LLAMA = {"family": "llama", "n_layer": 4, "d_model": 64, "n_head": 4, "n_kv_head": 2, "ffn_hidden": 160,
         "seq_len": 32, "rope_theta": 500000.0, "norm_eps": 1e-6}
MOE = {"experts": 4, "top_k": 2, "every": 2}


def plan_for(**overrides):
    model = {**LLAMA, **overrides.pop("model", {})}
    return make_plan(parse_spec(tiny_spec(**{"model": model, "global_batch": 8, **overrides})))


def plan_error(**overrides) -> PlanError:
    with pytest.raises(PlanError) as info:
        plan_for(**overrides)
    return info.value


def test_a_llama_spec_with_every_field_validates_and_plans_at_3d():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    plan = plan_for(model={"rope_scaling": rope, "tie_embeddings": False},
                    parallel={"dp": 2, "pp": 2, "tp": 2, "microbatches": 2})
    m = plan.config.model
    assert (m.family, m.n_kv_head, m.ffn_hidden, m.rope_scaling.factor) == ("llama", 2, 160, 8.0)
    assert family_of(m) is FAMILIES["llama"]
    assert "activations" in format_plan(describe(plan))


def test_llama_ffn_hidden_defaults_to_llamas_rule_and_gpt2s_to_four_d_model():
    llama = parse_spec(tiny_spec(model={**LLAMA, "ffn_hidden": None, "d_model": 96})).model
    assert family_of(llama).ffn_hidden(llama) == 256  # int(8 x 96 / 3) = 256, a multiple of 256 already
    assert family_of(llama).ffn_hidden(parse_spec(tiny_spec(model={**LLAMA, "ffn_hidden": None,
                                                                   "d_model": 128})).model) == 512  # 341 -> 512
    gpt2 = parse_spec(tiny_spec()).model
    assert gpt2.family == "gpt2" and family_of(gpt2).ffn_hidden(gpt2) == 4 * gpt2.d_model


@pytest.mark.parametrize("field,overrides,message", [
    ("model.n_kv_head", {"parallel": {"tp": 4}}, "tp=4 does not divide n_kv_head=2"),
    ("model.n_kv_head", {"model": {"n_kv_head": 3}}, "n_kv_head=3 does not divide n_head=4"),
    ("model.activation", {"model": {"activation": "gelu_tanh"}}, "llama's MLP is SwiGLU"),
    ("model.n_head", {"model": {"n_head": 64, "n_kv_head": None}}, "head size d_model / n_head = 1 is odd"),
    ("model.rope_scaling.high_freq_factor", {"model": {"rope_scaling": {"low_freq_factor": 4.0}}},
     "must exceed low_freq_factor=4.0"),
    ("model.n_kv_head", {"model": {"family": "gpt2", "rope_theta": 10000.0}},
     "family gpt2 has no grouped-query attention"),
    ("model.rope_scaling", {"model": {"family": "gpt2", "n_kv_head": None, "rope_theta": 10000.0,
                                      "rope_scaling": {}}}, "gpt2 has learned positions"),
    ("model.rope_theta", {"model": {"family": "gpt2", "n_kv_head": None}}, "gpt2 has learned positions"),
    ("model.n_kv_head", {"model": {"family": "qwen2"}, "parallel": {"tp": 4}}, "tp=4 does not divide n_kv_head=2"),
    ("model.sliding_window", {"model": {"sliding_window": 8}}, "a sliding window is family mistral's"),
    ("model.sliding_window", {"model": {"family": "qwen3", "sliding_window": 8}}, "family qwen3 attends over"),
    ("model.head_dim", {"model": {"family": "qwen3", "head_dim": 15}}, "head_dim=15 is odd"),
    ("model.head_dim", {"model": {"family": "gpt2", "n_kv_head": None, "rope_theta": 10000.0, "head_dim": 32}},
     "head_dim must be null or 16"),
    ("model.moe", {"model": {"family": "qwen3_moe"}}, "family qwen3_moe has mixture-of-experts blocks"),
])
def test_family_rules_name_the_field(field, overrides, message):
    err = plan_error(**overrides)
    assert err.field == field and message in err.message, (err.field, err.message)


@pytest.mark.parametrize("model,field", [
    ({"family": "mamba"}, "model.family"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "model.rope_scaling.rope_type"),
    ({"rope_scaling": {"beta_fast": 32}}, "model.rope_scaling.beta_fast"),
    ({"n_kv_head": 0}, "model.n_kv_head"),
    ({"norm_eps": 0}, "model.norm_eps"),
])
def test_unknown_or_out_of_range_model_options_are_refused_by_the_spec(model, field):
    with pytest.raises(SpecError) as info:
        parse_spec(tiny_spec(model={**LLAMA, **model}))
    assert field in [f for f, _ in info.value.errors], info.value.errors


def real_numel(plan, rank: int) -> int:
    """Parameters of the stages the rank builds (tp = 1: the whole tensors), tied ones once."""
    pp, family = plan.coords(rank).pp, family_of(plan.config.model)
    params = {}
    for c, layers in enumerate(plan.chunk_layers(pp)):
        v = c * plan.pp + pp
        stage = family.build_stage(plan.config.model, layers, first=v == 0, last=v == plan.n_virtual_stages - 1,
                                   seed=0, experts=plan.experts_of(rank))
        params |= {id(p): p.numel() for p in stage.parameters()}
    return sum(params.values())


@pytest.mark.parametrize("overrides", [
    {},
    {"model": {"tie_embeddings": True, "n_kv_head": 4}},
    {"parallel": {"pp": 2, "vpp": 2, "microbatches": 2, "schedule": "interleaved-1f1b"}},
    {"model": {"moe": MOE}, "parallel": {"dp": 2, "ep": 2, "pp": 2}},
    {"model": {"family": "gpt2", "n_kv_head": None, "rope_theta": 10000.0, "ffn_hidden": 96,
               "activation": "gelu_tanh", "moe": MOE}},
    {"model": {"family": "qwen2", "tie_embeddings": True}},
    {"model": {"family": "qwen3", "head_dim": 32}, "parallel": {"pp": 2}},
    {"model": {"family": "qwen3_moe", "head_dim": 8, "moe": {**MOE, "norm_topk_prob": False}},
     "parallel": {"dp": 2, "ep": 2, "pp": 2}},
    {"model": {"family": "mistral", "sliding_window": 8}},
], ids=["llama-gqa", "llama-tied", "llama-pp2-vpp2", "llama-moe-ep2-pp2", "gpt2-ffn96-moe", "qwen2-tied",
        "qwen3-head32-pp2", "qwen3_moe-ep2-pp2", "mistral-window8"])
def test_parameter_counts_equal_the_real_stages(overrides):
    plan = plan_for(**overrides)
    for rank in range(plan.world_size):
        assert param_counts(plan, plan.coords(rank).pp).total == real_numel(plan, rank), rank


def test_tensor_parallel_splits_kv_heads_and_the_swiglu_but_not_the_norms():
    one, two = param_counts(plan_for(), 0), param_counts(plan_for(parallel={"tp": 2}), 0)
    replicated = (4 * 2 + 1) * 64  # the RMSNorms: two per block and ln_f
    assert one.dense - replicated == 2 * (two.dense - replicated)


@pytest.mark.parametrize("family,replicated", [
    ("qwen2", (4 * 2 + 1) * 64),  # the RMSNorms; q, k and v's biases split with their weights
    ("qwen3", (4 * 2 + 1) * 64 + 4 * 2 * 32),  # and the per-head q and k norms (head_dim 32), whole on every rank
])
def test_tensor_parallel_splits_the_biases_but_not_the_per_head_norms(family, replicated):
    model = {"family": family, "head_dim": 32 if family == "qwen3" else None}
    one = param_counts(plan_for(model=model), 0)
    two = param_counts(plan_for(model=model, parallel={"tp": 2}), 0)
    assert one.dense - replicated == 2 * (two.dense - replicated)


def measured_activations(plan) -> int:
    """Peak bytes saved for backward by one micro-batch through the whole model, as the pipeline meters it."""
    cfg = plan.config
    model = full_model(cfg.model, seed=0)
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    meter = _SavedTensorMeter(list(model.parameters()))
    ids = torch.randint(cfg.model.vocab_size, (plan.micro_batch_size, cfg.model.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack), \
            autocast_context(cfg.precision, torch.device("cpu"))():
        model.loss_sum(model(ids[:, :-1]), ids[:, 1:])
    return meter.peak


@pytest.mark.parametrize("overrides", [
    {},
    {"precision": "bf16", "activation_checkpointing": "selective"},
    {"activation_checkpointing": "full"},
    {"precision": "bf16", "model": {"moe": MOE}},
    {"model": {"family": "qwen2"}},
    {"model": {"family": "qwen3", "head_dim": 32}},
    {"precision": "bf16", "model": {"family": "qwen3", "head_dim": 32}},
    {"precision": "bf16", "model": {"family": "qwen3_moe", "moe": {**MOE, "every": 1}}},
    {"model": {"family": "mistral", "sliding_window": 8}},
], ids=["fp32", "bf16-selective", "full", "moe-bf16", "qwen2", "qwen3", "qwen3-bf16", "qwen3_moe-bf16",
        "mistral-window8"])
def test_the_llama_activation_estimate_matches_the_meter(overrides):
    plan = plan_for(**overrides)
    assert plan.memory()[0].activations == pytest.approx(measured_activations(plan), rel=0.02)


def test_flops_per_token_count_the_matmul_parameters_and_only_the_chosen_experts():
    gpt2 = parse_spec(tiny_spec(model={"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 32})).model
    named = dict(full_model(gpt2, seed=0).named_parameters())
    matmul = sum(p.numel() for n, p in named.items() if n.split(".")[0] not in ("wte", "wpe"))
    assert family_of(gpt2).flops_per_token(gpt2) == 6 * matmul + 12 * 4 * 64 * 32  # bench/gpu.py's formula

    dense = plan_for().config.model
    moe = plan_for(model={"moe": {**MOE, "every": 1, "top_k": 1}}).config.model
    # every block's MLP becomes 4 experts (and a router), of which a token meets one
    assert family_of(moe).flops_per_token(moe) - family_of(dense).flops_per_token(dense) == 6 * 4 * 64 * 4
