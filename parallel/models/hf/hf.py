"""The transformers backend's Hugging Face mapping: the identity, since its parameters carry the checkpoint's names.

It claims a config.json no native family reads (`parallel.io.hf_spec.model_fields` asks the native families first)
whose architecture transformers builds with `AutoModelForCausalLM` (`claims`); `ARCHITECTURES` is empty so no
native lookup matches it. `config_from_hf` keeps the whole config.json (`model.hf_config`, canonical JSON) beside
the sizes trainyard's plan reads from it; `config_to_hf` gives it back, so an export is what `save_pretrained`
writes: the same config.json and the state dict under the names transformers gives its tensors in a checkpoint
(`names.checkpoint_names`: GPT-NeoX's `lm_head` is `embed_out` there). A directory holding the in-memory names
instead is read too. The other names of a tied parameter (`tied_keys`) may be in a checkpoint and are not read.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping

from trainyard.parallel.config import ModelConfig, RuleError
from trainyard.parallel.models.hf_mapping import Source

FAMILY = "hf"
ARCHITECTURES: tuple[str, ...] = ()
MODEL_TYPES: tuple[str, ...] = ()
EXTRA = "pip install 'trainyard[hf]'"


def causal_lm_architectures() -> set[str] | None:
    """The `architectures` transformers' `AutoModelForCausalLM` builds; None when transformers is not installed."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def claims(hf: Mapping) -> bool:
    """Whether the backend trains this config.json: one architecture, an `AutoModelForCausalLM` one. RuleError
    when it would but transformers is not installed."""
    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or not isinstance(architectures[0], str):
        return False
    known = causal_lm_architectures()
    if known is None:
        raise RuleError("architectures", f"{architectures[0]} has no native family; the transformers backend "
                                         f"(model.family: hf) would train it, but transformers is not installed "
                                         f"({EXTRA})")
    return architectures[0] in known


def config_from_hf(hf: Mapping) -> dict:
    from trainyard.parallel.models.hf.build import config_object

    text = config_object(dict(hf)).get_text_config()
    n_head = text.num_attention_heads
    return {"family": FAMILY, "n_layer": text.num_hidden_layers, "n_head": n_head, "d_model": text.hidden_size,
            "vocab_size": text.vocab_size, "tie_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
            "n_kv_head": getattr(text, "num_key_value_heads", None) or n_head,
            "ffn_hidden": getattr(text, "intermediate_size", None),
            "hf_config": json.dumps(dict(hf), sort_keys=True)}


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.hf_config is None:
        raise RuleError("model.hf_config", "the hf family needs the model's config.json")
    return dict(json.loads(cfg.hf_config))


def sources(cfg: ModelConfig, hf_keys: Collection[str] | None = None) -> dict[str, Source]:
    """Each parameter's checkpoint tensor: its checkpoint name, or its own name where `hf_keys` hold that instead."""
    from trainyard.parallel.models.hf.structure import structure

    assert cfg.hf_config is not None
    s = structure(cfg.hf_config)
    keys = set(hf_keys) if hf_keys is not None else set()
    return {name: Source(name if disk not in keys and name in keys else disk)
            for name, disk in s.checkpoint.items() if name in s.shapes}


def tied_keys(cfg: ModelConfig) -> set[str]:
    """Names a checkpoint may give a tied parameter besides the one read (both spellings of each)."""
    from trainyard.parallel.models.hf.structure import structure

    assert cfg.hf_config is not None
    s = structure(cfg.hf_config)
    return set(s.aliases) | {s.checkpoint[other] for other in s.aliases}


def ignored(key: str) -> bool:
    """Old checkpoints store rotary frequencies (transformers drops them too)."""
    return key.endswith("rotary_emb.inv_freq")
