"""Model families against transformers' own models: llama (grouped-query attention, untied and tied, Llama 3
rope scaling) against `LlamaForCausalLM`, llama with MoE blocks against `MixtralForCausalLM`, gpt2 with the
tanh GELU against `GPT2LMHeadModel`; tiny models built from configs, weights copied by a name map written
here. Logits must agree within 1e-5 in fp32."""

from __future__ import annotations

import pytest
import torch
from trainyard.parallel.config import ModelConfig, MoEConfig, RopeScalingConfig
from trainyard.parallel.models.whole import full_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

TOL = 1e-5
D, HEADS, KV, FFN, VOCAB, T = 32, 4, 2, 48, 128, 16


def tokens() -> torch.Tensor:
    return torch.randint(VOCAB, (2, T), generator=torch.Generator().manual_seed(0))


def our_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.ln_f(model(ids)))


def copy_in(hf: torch.nn.Module, ours: torch.nn.Module, names: dict[str, str | torch.Tensor]) -> None:
    """Set each HF tensor from ours (a name) or from a tensor built from ours; every HF tensor must be set."""
    mine = dict(ours.named_parameters(remove_duplicate=False))
    state = hf.state_dict()
    assert set(names) == set(state), set(state) ^ set(names)
    hf.load_state_dict({k: (mine[v] if isinstance(v, str) else v).detach().clone() for k, v in names.items()})


def llama_names(cfg: ModelConfig) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "wte.weight", "model.norm.weight": "ln_f.weight",
             "lm_head.weight": "lm_head.weight"}
    for i in range(cfg.n_layer):
        hf, us = f"model.layers.{i}", f"blocks.{i}"
        names |= {f"{hf}.input_layernorm.weight": f"{us}.ln_1.weight",
                  f"{hf}.post_attention_layernorm.weight": f"{us}.ln_2.weight",
                  **{f"{hf}.self_attn.{a}_proj.weight": f"{us}.attn.{b}.weight"
                     for a, b in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "proj"))}}
        if not cfg.is_moe_block(i):
            names |= {f"{hf}.mlp.{p}_proj.weight": f"{us}.mlp.{p}.weight" for p in ("gate", "up", "down")}
    return names


def llama_cfg(**overrides) -> ModelConfig:
    return ModelConfig(**{"family": "llama", "n_layer": 2, "n_head": HEADS, "n_kv_head": KV, "d_model": D,
                          "ffn_hidden": FFN, "vocab_size": VOCAB, "seq_len": T, "rope_theta": 500000.0,
                          **overrides})


def hf_llama_config(cfg: ModelConfig) -> dict:
    scaling = cfg.rope_scaling
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta} if scaling is None else {
        "rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings}
    return {"vocab_size": VOCAB, "hidden_size": D, "intermediate_size": FFN, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": HEADS, "num_key_value_heads": cfg.n_kv_head, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": rope, "max_position_embeddings": 64, "tie_word_embeddings": cfg.tie_embeddings}


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_embeddings": True, "n_kv_head": HEADS},
    {"rope_scaling": RopeScalingConfig(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=8)},
], ids=["gqa-untied", "tied-mha", "llama3-rope-scaling"])
def test_llama_logits_equal_transformers_llama(overrides):
    cfg = llama_cfg(**overrides)
    ours = full_model(cfg, seed=1)
    hf = LlamaForCausalLM(LlamaConfig(**hf_llama_config(cfg))).eval()
    names = llama_names(cfg)
    if cfg.tie_embeddings:
        assert ours.lm_head.weight is ours.wte.weight
        names = {k: v for k, v in names.items() if k in hf.state_dict()}
    copy_in(hf, ours, names)
    ids = tokens()
    with torch.no_grad():
        diff = (our_logits(ours, ids) - hf(ids).logits).abs().max().item()
    assert diff < TOL


def test_llama_moe_logits_equal_transformers_mixtral():
    # Mixtral routes as trainyard's dropless MoE does: softmax over experts, top-k, renormalised over the k.
    # transformers 5 fuses each layer's experts into 3-D tensors: gate_up_proj[e] = [gate; up], down_proj[e].
    cfg = llama_cfg(moe=MoEConfig(experts=4, top_k=2, every=1, capacity_factor=None))
    ours = full_model(cfg, seed=2)
    mine = dict(ours.named_parameters())
    hf_cfg = hf_llama_config(cfg)
    hf = MixtralForCausalLM(MixtralConfig(**hf_cfg, num_local_experts=4, num_experts_per_tok=2,
                                          router_jitter_noise=0.0)).eval()
    names: dict[str, str | torch.Tensor] = dict(llama_names(cfg))
    for i in range(cfg.n_layer):
        e = [f"blocks.{i}.moe.experts.{j}" for j in range(4)]
        names[f"model.layers.{i}.mlp.gate.weight"] = f"blocks.{i}.moe.router.weight"
        names[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([mine[f"{x}.gate.weight"], mine[f"{x}.up.weight"]]) for x in e])
        names[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([mine[f"{x}.down.weight"] for x in e])
    copy_in(hf, ours, names)
    ids = tokens()
    with torch.no_grad():
        diff = (our_logits(ours, ids) - hf(ids).logits).abs().max().item()
    assert diff < TOL


def test_gpt2_with_tanh_gelu_equals_transformers_gpt2():
    cfg = ModelConfig(n_layer=2, n_head=HEADS, d_model=D, vocab_size=VOCAB, seq_len=T, context_len=24,
                      tie_embeddings=True, activation="gelu_tanh")
    ours = full_model(cfg, seed=3)
    mine = dict(ours.named_parameters())
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=24, n_embd=D, n_layer=2, n_head=HEADS,
                                    activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                    eos_token_id=0)).eval()
    names: dict[str, str | torch.Tensor] = {"transformer.wte.weight": "wte.weight", "lm_head.weight": "lm_head.weight",
                                            "transformer.wpe.weight": "wpe.weight",
                                            "transformer.ln_f.weight": "ln_f.weight",
                                            "transformer.ln_f.bias": "ln_f.bias"}
    for i in range(cfg.n_layer):
        hf_, us = f"transformer.h.{i}", f"blocks.{i}"
        qkv = [f"{us}.attn.{x}" for x in "qkv"]
        names |= {f"{hf_}.{n}.{w}": f"{us}.{n}.{w}" for n in ("ln_1", "ln_2") for w in ("weight", "bias")}
        # Conv1D keeps (in, out): our Linear weights transposed; c_attn is q, k and v side by side.
        names[f"{hf_}.attn.c_attn.weight"] = torch.cat([mine[f"{x}.weight"] for x in qkv]).T
        names[f"{hf_}.attn.c_attn.bias"] = torch.cat([mine[f"{x}.bias"] for x in qkv])
        for hf_name, us_name in (("attn.c_proj", "attn.proj"), ("mlp.c_fc", "mlp.fc"), ("mlp.c_proj", "mlp.proj")):
            names[f"{hf_}.{hf_name}.weight"] = mine[f"{us}.{us_name}.weight"].T
            names[f"{hf_}.{hf_name}.bias"] = f"{us}.{us_name}.bias"
    copy_in(hf, ours, names)
    ids = tokens()
    with torch.no_grad():
        diff = (our_logits(ours, ids) - hf(ids).logits).abs().max().item()
    assert diff < TOL
    # the option is honoured: the exact GELU lands measurably further from gelu_new (tiny weights keep both close)
    exact = full_model(ModelConfig(**{**cfg.__dict__, "activation": "gelu"}), seed=3)
    with torch.no_grad():
        exact_diff = (our_logits(exact, ids) - hf(ids).logits).abs().max().item()
    print(f"gelu_tanh {diff:.2e}, exact gelu {exact_diff:.2e}")
    assert exact_diff > 10 * diff
