"""The llama family <-> Hugging Face `LlamaForCausalLM` and `MixtralForCausalLM`: config.json and names.

Dense: names map one to one (trainyard's rotary embedding follows HF's rotate_half convention, so q and k
need no permutation). Grouped-query attention is `num_key_value_heads` -> `n_kv_head`; rope is
`rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling`, of type default or llama3.

MoE (Mixtral: every block's feed-forward is top-k routed SwiGLU experts, softmax over all experts and the
top k renormalised, as trainyard's router does): `block_sparse_moe.gate` is the router and experts
`w1`/`w3`/`w2` are gate/up/down. That per-expert spelling is what checkpoints hold on disk (transformers
5 fuses the experts in memory, as `mlp.experts.gate_up_proj` [E, 2 ffn, d] with gate first, and
`down_proj` [E, d, ffn], but `save_pretrained` writes them back per expert); a file holding the fused
tensors is read too.

A config.json field trainyard cannot honour is refused by name (RuleError): biases, another activation, a
sliding window, another rope type, router jitter (a head_dim other than hidden_size / num_attention_heads is
`model.head_dim`). A field config.json
leaves out takes its architecture's default in transformers (`DEFAULTS`): Mixtral's rope_theta, rms_norm_eps
and key/value heads are not Llama's.

`dense_fields`, `dense_to_hf`, `dense_sources` and `fused_expert_sources` are what llama's kin (mistral, qwen2,
qwen3, qwen3_moe: each its own `hf.py`) share with it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from trainyard.parallel.config import ModelConfig, NotNative, RuleError
from trainyard.parallel.models.components.hf_mapping import Source, hf_bool

FAMILY = "llama"
ARCHITECTURES = ("LlamaForCausalLM", "MixtralForCausalLM")
MODEL_TYPES = ("llama", "mixtral")
ROPE_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DEFAULTS = {"LlamaForCausalLM": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
            "MixtralForCausalLM": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_key_value_heads": 8,
                                   "num_local_experts": 8, "num_experts_per_tok": 2}}
"""transformers' LlamaConfig / MixtralConfig defaults of the fields trainyard reads that config.json may leave out
(a null num_key_value_heads is num_attention_heads in both)."""


def config_from_hf(hf: Mapping) -> dict:
    architecture = (hf.get("architectures") or ARCHITECTURES[:1])[0]
    hf = DEFAULTS[architecture] | dict(hf)
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise NotNative(field, "is true; trainyard's llama has no biases")
    if hf.get("sliding_window") is not None or hf.get("use_sliding_window"):
        raise NotNative("sliding_window", f"is {hf.get('sliding_window')!r}; trainyard's llama attends over the whole "
                                          "causal context (a sliding window is MistralForCausalLM's)")
    if hf.get("router_jitter_noise"):
        raise NotNative("router_jitter_noise", "trainyard's router adds no jitter noise")
    fields = dense_fields(hf, FAMILY)
    if "num_local_experts" in hf:
        fields["moe"] = {"experts": hf["num_local_experts"], "top_k": hf.get("num_experts_per_tok", 2), "every": 1}
    return fields


def dense_fields(hf: Mapping, family: str) -> dict:
    """The ModelConfig fields every llama-shaped config.json fixes (`hf` with its architecture's defaults):
    sizes, heads (`head_dim` where it is not hidden_size / num_attention_heads), norms, rope, tied embeddings.
    The family's own refusals (biases, windows) are its caller's."""
    if hf.get("hidden_act", "silu") != "silu":
        raise NotNative("hidden_act", f"{hf['hidden_act']!r} is not supported (trainyard's {family}: silu)")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0):
        raise RuleError("head_dim", f"is {head_dim!r}, not a positive integer")
    if head_dim is None and d % heads:
        raise RuleError("head_dim", f"is null and num_attention_heads={heads} does not divide hidden_size={d}")
    theta, scaling = _rope(hf)
    return {"family": family, "n_layer": hf["num_hidden_layers"], "n_head": heads, "d_model": d,
            "n_kv_head": hf.get("num_key_value_heads") or heads, "ffn_hidden": hf["intermediate_size"],
            "head_dim": None if d % heads == 0 and head_dim in (None, d // heads) else head_dim,
            "vocab_size": hf["vocab_size"], "context_len": hf.get("max_position_embeddings"),
            "tie_embeddings": hf_bool(hf, "tie_word_embeddings", False),
            "norm_eps": float(hf["rms_norm_eps"]), "rope_theta": theta, "rope_scaling": scaling}


def _rope(hf: Mapping) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either spelling (rope_parameters without rope_theta takes the top-level
    one, as transformers does); an unknown rope type is refused."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = {**(hf.get("rope_scaling") or {}), "rope_theta": hf["rope_theta"]}
        field = "rope_scaling"
    theta = float(params.get("rope_theta", hf["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise NotNative(f"{field}.rope_type", f"{kind!r} is not supported (supported: default, llama3)")
    missing = [f for f in ROPE_SCALING_FIELDS if f not in params]
    if missing:
        raise RuleError(field, f"llama3 rope scaling without {', '.join(missing)}")
    scaling = {"rope_type": "llama3"} | {f: params[f] for f in ROPE_SCALING_FIELDS}
    return theta, scaling



def config_to_hf(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    if moe is not None and moe.every != 1:
        raise RuleError("model.moe.every", f"is {moe.every}; MixtralForCausalLM has experts in every block "
                                           "(every: 1), so this model has no Hugging Face form")
    if moe is not None and not moe.norm_topk_prob:
        raise RuleError("model.moe.norm_topk_prob", "is false; MixtralForCausalLM renormalises the top-k "
                                                    "probabilities, so this model has no Hugging Face form")
    out = dense_to_hf(cfg, ARCHITECTURES[1] if moe else ARCHITECTURES[0], "mixtral" if moe else "llama")
    if moe is None:
        out |= {"attention_bias": False, "mlp_bias": False}
    else:
        out |= {"num_local_experts": moe.experts, "num_experts_per_tok": moe.top_k, "sliding_window": None,
                "router_jitter_noise": 0.0, "router_aux_loss_coef": moe.aux_loss_coef}
    return out


def dense_to_hf(cfg: ModelConfig, architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json fields every llama-shaped architecture writes alike."""
    out: dict[str, Any]
    out = {"architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "intermediate_size": _ffn(cfg), "num_hidden_layers": cfg.n_layer,
           "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
           "head_dim": cfg.head_size, "hidden_act": "silu", "max_position_embeddings": cfg.context,
           "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
           "rope_theta": cfg.rope_theta, "attention_dropout": 0.0, "dtype": "float32"}
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = {"rope_type": "llama3"} | {f: getattr(cfg.rope_scaling, f) for f in ROPE_SCALING_FIELDS}
    return out


def _ffn(cfg: ModelConfig) -> int:
    from trainyard.parallel.models import family_of

    return family_of(cfg).ffn_hidden(cfg)


def sources(cfg: ModelConfig, hf_keys: Collection[str] | None = None) -> dict[str, Source]:
    out = dense_sources(cfg)
    fused = hf_keys is not None and any(k.endswith(".mlp.experts.gate_up_proj") for k in hf_keys)
    for i in cfg.moe_blocks:
        b, h = f"blocks.{i}", f"model.layers.{i}"
        if fused:
            out |= fused_expert_sources(cfg, b, h)
            continue
        out[f"{b}.moe.router.weight"] = Source(f"{h}.block_sparse_moe.gate.weight")
        for e in range(cfg.experts):
            x, y = f"{b}.moe.experts.{e}", f"{h}.block_sparse_moe.experts.{e}"
            out |= {f"{x}.{ours}.weight": Source(f"{y}.{theirs}.weight")
                    for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}
    return out


def dense_sources(cfg: ModelConfig) -> dict[str, Source]:
    """Every llama-shaped architecture's names alike: embedding, norms, attention weights, dense MLPs (an MoE
    block's feed-forward part is the caller's)."""
    out = {"wte.weight": Source("model.embed_tokens.weight"), "ln_f.weight": Source("model.norm.weight"),
           "lm_head.weight": Source("model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight")}
    for i in range(cfg.n_layer):
        b, h = f"blocks.{i}", f"model.layers.{i}"
        out[f"{b}.ln_1.weight"] = Source(f"{h}.input_layernorm.weight")
        out[f"{b}.ln_2.weight"] = Source(f"{h}.post_attention_layernorm.weight")
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("proj", "o_proj")):
            out[f"{b}.attn.{ours}.weight"] = Source(f"{h}.self_attn.{theirs}.weight")
        if not cfg.is_moe_block(i):
            out |= {f"{b}.mlp.{n}.weight": Source(f"{h}.mlp.{n}_proj.weight") for n in ("gate", "up", "down")}
    return out


def fused_expert_sources(cfg: ModelConfig, b: str, h: str) -> dict[str, Source]:
    """An MoE block held as transformers 5 holds it in memory: router `mlp.gate`, experts fused in
    `mlp.experts.gate_up_proj` [E, 2 ffn, d] (gate first) and `down_proj` [E, d, ffn]."""
    ffn = _ffn(cfg)
    out = {f"{b}.moe.router.weight": Source(f"{h}.mlp.gate.weight")}
    for e in range(cfg.experts):
        x = f"{b}.moe.experts.{e}"
        out[f"{x}.gate.weight"] = Source(f"{h}.mlp.experts.gate_up_proj", expert=e)
        out[f"{x}.up.weight"] = Source(f"{h}.mlp.experts.gate_up_proj", expert=e, start=ffn)
        out[f"{x}.down.weight"] = Source(f"{h}.mlp.experts.down_proj", expert=e)
    return out


def ignored(key: str) -> bool:
    # Older checkpoints store each block's rotary frequencies, which trainyard computes.
    return key.endswith(".rotary_emb.inv_freq")
