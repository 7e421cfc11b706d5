"""The gpt2 family <-> Hugging Face `GPT2LMHeadModel`: config.json fields and tensor names.

HF's GPT-2 keeps q, k and v as one Conv1D `c_attn` (in x 3 d_model, the three side by side) and every
projection as a Conv1D (weights in x out); trainyard's are separate `nn.Linear`s (out x in). Published
checkpoints spell names without the `transformer.` prefix that `save_pretrained` writes; both are read, the
prefixed one is written. `activation_function: gelu_new` (the tanh approximation published GPT-2 uses) is
trainyard's `gelu_tanh`.

A config.json field that changes what the model computes and that trainyard cannot reproduce is refused by
name (RuleError). Dropout probabilities are accepted: they act only while training, and trainyard trains
without dropout (docs/guide.md says so, under "Hugging Face checkpoints").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from trainyard.parallel.config import ModelConfig, NotNative, RuleError
from trainyard.parallel.models.components.hf_mapping import Source, hf_bool

FAMILY = "gpt2"
ARCHITECTURES = ("GPT2LMHeadModel",)
MODEL_TYPES = ("gpt2",)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
"""HF activation_function -> trainyard's `activation`."""
MUST_BE = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}
"""config.json fields trainyard computes only one way: field -> the value it supports."""


def config_from_hf(hf: Mapping) -> dict:
    for field, value in MUST_BE.items():
        if field in hf and bool(hf[field]) != value:
            raise NotNative(field, f"is {hf[field]!r}; trainyard's gpt2 supports only {value!r}")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise NotNative("activation_function", f"{act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    d = hf["n_embd"]
    if d % hf["n_head"]:
        raise RuleError("n_head", f"n_embd={d} is not divisible by n_head={hf['n_head']}")
    return {"family": FAMILY, "n_layer": hf["n_layer"], "n_head": hf["n_head"], "d_model": d,
              "vocab_size": hf["vocab_size"], "context_len": hf["n_positions"],
              "tie_embeddings": hf_bool(hf, "tie_word_embeddings", True),
              "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)), "activation": ACTIVATIONS[act],
              "ffn_hidden": hf.get("n_inner")}  # null: 4 x n_embd, as trainyard's null



def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.moe is not None:
        raise RuleError("model.moe", "GPT2LMHeadModel has no mixture-of-experts blocks: a gpt2 MoE model "
                                     "cannot be written as a Hugging Face checkpoint")
    activation, ffn = cfg.activation, cfg.ffn_hidden
    return {"architectures": list(ARCHITECTURES[:1]), "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.context, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_inner": ffn if ffn not in (None, 4 * cfg.d_model) else None,
            "activation_function": "gelu_new" if activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "dtype": "float32"}


def sources(cfg: ModelConfig, hf_keys: Collection[str] | None = None) -> dict[str, Source]:
    p = "transformer." if hf_keys is None or "transformer.wte.weight" in hf_keys else ""
    d = cfg.d_model
    out = {"wte.weight": Source(f"{p}wte.weight"), "wpe.weight": Source(f"{p}wpe.weight"),
           "ln_f.weight": Source(f"{p}ln_f.weight"), "ln_f.bias": Source(f"{p}ln_f.bias"),
           "lm_head.weight": Source("lm_head.weight" if not cfg.tie_embeddings else f"{p}wte.weight")}
    for i in range(cfg.n_layer):
        b, h = f"blocks.{i}", f"{p}h.{i}"
        for norm in ("ln_1", "ln_2"):
            out |= {f"{b}.{norm}.{kind}": Source(f"{h}.{norm}.{kind}") for kind in ("weight", "bias")}
        for j, name in enumerate(("q", "k", "v")):
            out[f"{b}.attn.{name}.weight"] = Source(f"{h}.attn.c_attn.weight", transpose=True, start=j * d)
            out[f"{b}.attn.{name}.bias"] = Source(f"{h}.attn.c_attn.bias", start=j * d)
        out[f"{b}.attn.proj.weight"] = Source(f"{h}.attn.c_proj.weight", transpose=True)
        out[f"{b}.attn.proj.bias"] = Source(f"{h}.attn.c_proj.bias")
        for ours, theirs in (("fc", "c_fc"), ("proj", "c_proj")):
            out[f"{b}.mlp.{ours}.weight"] = Source(f"{h}.mlp.{theirs}.weight", transpose=True)
            out[f"{b}.mlp.{ours}.bias"] = Source(f"{h}.mlp.{theirs}.bias")
    return out


def ignored(key: str) -> bool:
    # Older checkpoints store each block's causal mask as a buffer (attn.bias, attn.masked_bias).
    return key.endswith((".attn.bias", ".attn.masked_bias"))
