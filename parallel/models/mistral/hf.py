"""The mistral family <-> Hugging Face `MistralForCausalLM`: llama's names and fields
(`parallel.models.llama.hf`), and `sliding_window` (MistralConfig's default is 4096 when config.json leaves it
out; null in Mistral 7B v0.2 and later) <-> `model.sliding_window`. Biases and another activation are refused
by name, as llama's are.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from trainyard.parallel.config import ModelConfig, NotNative, RuleError
from trainyard.parallel.models.components.hf_mapping import Source
from trainyard.parallel.models.llama import hf as llama

FAMILY = "mistral"
ARCHITECTURES = ("MistralForCausalLM",)
MODEL_TYPES = ("mistral",)
DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_key_value_heads": 8, "sliding_window": 4096}
"""transformers' MistralConfig defaults of the fields trainyard reads that config.json may leave out."""


def config_from_hf(hf: Mapping) -> dict:
    hf = DEFAULTS | dict(hf)
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise NotNative(field, "is true; trainyard's mistral has no biases")
    if "layer_types" in hf:
        raise NotNative("layer_types", "per-layer attention types are Ministral's; trainyard's mistral gives every "
                                       "layer the one sliding_window")
    window = hf["sliding_window"]
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise RuleError("sliding_window", f"is {window!r}, not a positive integer or null")
    return llama.dense_fields(hf, FAMILY) | {"sliding_window": window}


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.moe is not None:
        raise RuleError("model.moe", "MistralForCausalLM is a dense model, so this model has no Hugging Face form")
    return llama.dense_to_hf(cfg, ARCHITECTURES[0], "mistral") | {"sliding_window": cfg.sliding_window}


def sources(cfg: ModelConfig, hf_keys: Collection[str] | None = None) -> dict[str, Source]:
    return llama.dense_sources(cfg)


def ignored(key: str) -> bool:
    return llama.ignored(key)
