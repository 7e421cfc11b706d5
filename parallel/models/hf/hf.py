"""The transformers backend's Hugging Face mapping: each parameter under the name transformers gives it in a
checkpoint (`names.checkpoint_names`).

It claims a config.json no native family reads (`parallel.io.hf_spec.model_fields` asks the native families first)
whose architecture transformers builds with `AutoModelForCausalLM` (`claims`); `ARCHITECTURES` is empty so no
native lookup matches it. `config_from_hf` keeps the whole config.json (`model.hf_config`, canonical JSON) beside
the sizes trainyard's plan reads from it; `config_to_hf` gives it back, so an export is what `save_pretrained`
writes: the same config.json and the state dict under the names `save_pretrained` writes (GPT-NeoX's `lm_head` is
`embed_out` there; a tied parameter once, under the name `from_pretrained` ties the others to). A checkpoint that
spells a parameter otherwise (a tied copy's name, the name in memory) is read too (`sources`, `tied_keys`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping

from trainyard.parallel.config import ModelConfig, RuleError
from trainyard.parallel.models.components.hf_mapping import Source

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
    """Each parameter's checkpoint tensor: the name save_pretrained writes, or another spelling `hf_keys` hold
    (another name of a tied parameter, the name in memory)."""
    from trainyard.parallel.models.hf.structure import structure

    assert cfg.hf_config is not None
    names = structure(cfg.hf_config).names
    keys = set(hf_keys) if hf_keys is not None else set()
    return {name: Source(next((k for k in spellings if k in keys), spellings[0]))
            for name, spellings in names.spellings.items()}


def tied_keys(cfg: ModelConfig) -> set[str]:
    """The other spellings of the parameters (`sources`): a checkpoint may hold them beside the one read (the
    tied copies save_pretrained drops, which older checkpoints hold), and they are not read."""
    from trainyard.parallel.models.hf.structure import structure

    assert cfg.hf_config is not None
    return {key for spellings in structure(cfg.hf_config).names.spellings.values() for key in spellings[1:]}


def ignored(key: str) -> bool:
    """Old checkpoints store rotary frequencies (transformers drops them too)."""
    return key.endswith("rotary_emb.inv_freq")
