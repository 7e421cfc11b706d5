"""The qwen2 family <-> Hugging Face `Qwen2ForCausalLM`: llama's mapping (`parallel.models.llama.hf`) plus the
q, k and v biases (`self_attn.{q,k,v}_proj.bias`).

Qwen2's optional sliding window (`use_sliding_window: true`, on the layers from `max_window_layers` on) is
refused by name; `sliding_window` alone, which published configs carry with use_sliding_window false, means
nothing to transformers and is ignored as it does. A MoE model has no Qwen2 form (Qwen2-MoE's shared experts are
not trainyard's).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from trainyard.parallel.config import ModelConfig, NotNative, RuleError
from trainyard.parallel.models.components.hf_mapping import Source
from trainyard.parallel.models.llama import hf as llama

FAMILY = "qwen2"
ARCHITECTURES = ("Qwen2ForCausalLM",)
MODEL_TYPES = ("qwen2",)
DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_key_value_heads": 32}
"""transformers' Qwen2Config defaults of the fields trainyard reads that config.json may leave out."""


def refuse_window(hf: Mapping) -> None:
    """Qwen's sliding window is on only with use_sliding_window (transformers drops sliding_window otherwise)."""
    if hf.get("use_sliding_window"):
        raise NotNative("use_sliding_window", "is true; trainyard's Qwen models attend over the whole causal "
                                              "context (a sliding window is MistralForCausalLM's)")


def config_from_hf(hf: Mapping) -> dict:
    hf = DEFAULTS | dict(hf)
    refuse_window(hf)
    return llama.dense_fields(hf, FAMILY)


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.moe is not None:
        raise RuleError("model.moe", "Qwen2ForCausalLM is a dense model, so this model has no Hugging Face form")
    return llama.dense_to_hf(cfg, ARCHITECTURES[0], "qwen2") | {"use_sliding_window": False, "sliding_window": None}


def sources(cfg: ModelConfig, hf_keys: Collection[str] | None = None) -> dict[str, Source]:
    out = llama.dense_sources(cfg)
    for i in range(cfg.n_layer):
        out |= {f"blocks.{i}.attn.{n}.bias": Source(f"model.layers.{i}.self_attn.{n}_proj.bias") for n in "qkv"}
    return out


def ignored(key: str) -> bool:
    return llama.ignored(key)
