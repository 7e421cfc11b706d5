"""The qwen3_moe family <-> Hugging Face `Qwen3MoeForCausalLM`: qwen3's attention mapping
(`parallel.models.qwen3.hf`) and its experts.

MoE: `mlp.gate` is the router; experts are `mlp.experts.{e}.{gate,up,down}_proj` on disk (what `save_pretrained`
writes; transformers 5 fuses them in memory as `mlp.experts.gate_up_proj` and `down_proj`, which are read too).
`num_experts` (or its alias `num_local_experts`) -> `moe.experts`, `num_experts_per_tok` -> `moe.top_k`,
`norm_topk_prob` -> `moe.norm_topk_prob`, `decoder_sparse_step` -> `moe.every` (block i has experts when
(i + 1) % decoder_sparse_step == 0, trainyard's rule too), `moe_intermediate_size` -> `ffn_hidden`.

Refused by name: `mlp_only_layers` (dense blocks at chosen places), and a `decoder_sparse_step` above 1 whose
dense blocks' `intermediate_size` is not the experts' width (trainyard's dense blocks and experts share
`ffn_hidden`). The router's auxiliary loss is the one `parallel.models.components.moe` computes for every family
(Mixtral's port too), whose weight stays the spec's `moe.aux_loss_coef` (written back as `router_aux_loss_coef`).
transformers' `load_balancing_loss_func` (the same function for Mixtral and Qwen3-MoE, added to the loss only
with `output_router_logits`, false by default) takes its expert fractions and mean probabilities over the
tokens of all layers at once, which no pipeline stage holds; trainyard's is the same Switch form per layer and
sequence, its fractions of the k x seq_len choices (1/k of transformers' sum over the k slots).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from trainyard.parallel.config import ModelConfig, NotNative, RuleError
from trainyard.parallel.models.components.hf_mapping import Source, hf_bool
from trainyard.parallel.models.llama import hf as llama
from trainyard.parallel.models.qwen3 import hf as qwen3

FAMILY = "qwen3_moe"
ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPES = ("qwen3_moe",)
DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_key_value_heads": 4, "decoder_sparse_step": 1,
            "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False}
"""transformers' Qwen3MoeConfig defaults of the fields trainyard reads that config.json may leave out."""


def config_from_hf(hf: Mapping) -> dict:
    hf = DEFAULTS | dict(hf)
    if hf.get("mlp_only_layers"):
        raise NotNative("mlp_only_layers", f"is {hf['mlp_only_layers']!r}; trainyard places MoE blocks every "
                                           "decoder_sparse_step blocks only (leave mlp_only_layers empty)")
    step, width = hf["decoder_sparse_step"], hf["moe_intermediate_size"]
    if step != 1 and hf.get("intermediate_size", width) != width:
        raise NotNative("intermediate_size", f"is {hf['intermediate_size']} and moe_intermediate_size {width}: with "
                                             f"decoder_sparse_step={step} trainyard's dense blocks and experts share "
                                             "one width")
    fields = qwen3.attention_fields(hf | {"intermediate_size": width}, FAMILY)
    experts = hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"]
    fields["moe"] = {"experts": experts, "top_k": hf["num_experts_per_tok"], "every": step,
                     "norm_topk_prob": hf_bool(hf, "norm_topk_prob", False)}
    return fields


def config_to_hf(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    if moe is None:
        raise RuleError("model.moe", "Qwen3MoeForCausalLM has experts (a dense model is family qwen3)")
    out = llama.dense_to_hf(cfg, ARCHITECTURES[0], "qwen3_moe")
    return out | {"moe_intermediate_size": out["intermediate_size"], "num_experts": moe.experts,
                  "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.norm_topk_prob,
                  "decoder_sparse_step": moe.every, "mlp_only_layers": [], "router_aux_loss_coef": moe.aux_loss_coef,
                  "attention_bias": False, "use_sliding_window": False, "sliding_window": None}


def sources(cfg: ModelConfig, hf_keys: Collection[str] | None = None) -> dict[str, Source]:
    out = llama.dense_sources(cfg) | qwen3.norm_sources(cfg)
    fused = hf_keys is not None and any(k.endswith(".mlp.experts.gate_up_proj") for k in hf_keys)
    for i in cfg.moe_blocks:
        b, h = f"blocks.{i}", f"model.layers.{i}"
        if fused:
            out |= llama.fused_expert_sources(cfg, b, h)
            continue
        out[f"{b}.moe.router.weight"] = Source(f"{h}.mlp.gate.weight")
        for e in range(cfg.experts):
            out |= {f"{b}.moe.experts.{e}.{n}.weight": Source(f"{h}.mlp.experts.{e}.{n}_proj.weight")
                    for n in ("gate", "up", "down")}
    return out


def ignored(key: str) -> bool:
    return llama.ignored(key)
