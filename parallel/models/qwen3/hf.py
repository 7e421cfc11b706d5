"""The qwen3 family <-> Hugging Face `Qwen3ForCausalLM`: llama's mapping (`parallel.models.llama.hf`), the
per-head norms (`self_attn.q_norm` / `k_norm` <-> `attn.ln_q` / `ln_k`) and `head_dim` (Qwen3Config's default
is 128 whatever the hidden size).

Refused by name: `attention_bias: true` (biases on q, k, v and o) and `use_sliding_window: true`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from trainyard.parallel.config import ModelConfig, NotNative, RuleError
from trainyard.parallel.models.components.hf_mapping import Source
from trainyard.parallel.models.llama import hf as llama
from trainyard.parallel.models.qwen2.hf import refuse_window

FAMILY = "qwen3"
ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)
DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_key_value_heads": 32, "head_dim": 128}
"""transformers' Qwen3Config defaults of the fields trainyard reads that config.json may leave out."""


def attention_fields(hf: Mapping, family: str) -> dict:
    """What Qwen3 and Qwen3-MoE read alike (after their defaults)."""
    if hf.get("attention_bias"):
        raise NotNative("attention_bias", f"is true; trainyard's {family} has no attention biases")
    refuse_window(hf)
    return llama.dense_fields(hf, family)


def config_from_hf(hf: Mapping) -> dict:
    return attention_fields(DEFAULTS | dict(hf), FAMILY)


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.moe is not None:
        raise RuleError("model.moe", "Qwen3ForCausalLM is a dense model (family qwen3_moe has experts), so this "
                                     "model has no Hugging Face form")
    return llama.dense_to_hf(cfg, ARCHITECTURES[0], "qwen3") | {"attention_bias": False, "use_sliding_window": False,
                                                                "sliding_window": None}


def norm_sources(cfg: ModelConfig) -> dict[str, Source]:
    out: dict[str, Source] = {}
    for i in range(cfg.n_layer):
        out |= {f"blocks.{i}.attn.ln_{n}.weight": Source(f"model.layers.{i}.self_attn.{n}_norm.weight") for n in "qk"}
    return out


def sources(cfg: ModelConfig, hf_keys: Collection[str] | None = None) -> dict[str, Source]:
    return llama.dense_sources(cfg) | norm_sources(cfg)


def ignored(key: str) -> bool:
    return llama.ignored(key)
