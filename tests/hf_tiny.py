"""Tiny Hugging Face models, built from configs with transformers and saved with `save_pretrained` (nothing
is downloaded), for the Hugging Face checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256  # byte-level: the text data of examples/ trains them as they are


def tiny_gpt2(directory: Path, *, tied: bool = True, seed: int = 0, **overrides):
    """A GPT2LMHeadModel as published: gelu_new (tanh GELU), tied embeddings unless `tied=False`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, tie_word_embeddings=tied,
                        bos_token_id=0, eos_token_id=0, **overrides)
    return _saved(GPT2LMHeadModel(config), directory)


def tiny_llama(directory: Path, *, tied: bool = False, seed: int = 0, vocab_size: int = VOCAB, layers: int = 2,
               **overrides):
    """A LlamaForCausalLM with grouped-query attention (4 query heads, 2 key/value heads), untied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=64, rms_norm_eps=1e-5,
                         tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, **overrides)
    return _saved(LlamaForCausalLM(config), directory)


def tiny_mixtral(directory: Path, *, seed: int = 0, **overrides):
    """A MixtralForCausalLM: every block's feed-forward is 4 SwiGLU experts, top 2."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, bos_token_id=0, eos_token_id=0, **overrides)
    return _saved(MixtralForCausalLM(config), directory)


def tiny_qwen2(directory: Path, *, tied: bool = True, seed: int = 0, **overrides):
    """A Qwen2ForCausalLM: biases on q, k and v, tied embeddings (as the small published sizes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, rope_theta=1e6,
                         tie_word_embeddings=tied, **overrides)
    return _saved(Qwen2ForCausalLM(config), directory)


def tiny_qwen3(directory: Path, *, seed: int = 0, **overrides):
    """A Qwen3ForCausalLM: per-head q and k norms, heads 16 wide (not hidden_size / heads = 8), untied."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
                         tie_word_embeddings=False, **overrides)
    return _saved(Qwen3ForCausalLM(config), directory)


def tiny_mistral(directory: Path, *, seed: int = 0, window: int | None = 5, **overrides):
    """A MistralForCausalLM with a sliding window of `window` positions (shorter than the tests' sequences)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                           sliding_window=window, **overrides)
    return _saved(MistralForCausalLM(config), directory)


def tiny_qwen3_moe(directory: Path, *, seed: int = 0, **overrides):
    """A Qwen3MoeForCausalLM: 4 SwiGLU experts of width 24, top 2, norm_topk_prob false (Qwen3MoeConfig's
    default), heads 16 wide."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, **overrides)
    return _saved(Qwen3MoeForCausalLM(config), directory)


def _saved(model, directory: Path):
    with torch.no_grad():  # norms start at 1 and biases at 0: make them tell the tensors apart
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(directory)
    return model


BACKEND_ARCHITECTURES = ("gpt_neox", "gemma2", "olmo2")
"""Architectures no native family reads: the transformers backend (`model.family: hf`) trains them."""


def tiny_backend(name: str, directory: Path, *, seed: int = 0):
    """A tiny GPTNeoXForCausalLM (its head `embed_out` in checkpoints, `lm_head` in memory), Gemma2ForCausalLM
    (tied, soft-capped logits, sliding window on alternate layers, its own embedding scale), Olmo2ForCausalLM (q and
    k norms, post-norms) or GraniteForCausalLM (multipliers, logits / logits_scaling): `tiny_architecture`."""
    return tiny_architecture(name, directory, seed=seed)


def hf_val_loss(model, config) -> float:
    """transformers' mean loss of `model` over the validation batches of the job `config` (the job's `val_loss`)."""
    import torch.nn.functional as F
    from trainyard.parallel.data.datasets import load_batch, open_dataset
    from trainyard.parallel.data.sampler import validation_batches

    dataset = open_dataset(config, "val")
    losses, count = 0.0, 0
    with torch.no_grad():
        for ids in validation_batches(config, dataset.num_samples):
            inputs, targets = load_batch(dataset, ids)
            logits = model(inputs).logits
            losses += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
            count += targets.numel()
    return losses / count


def hf_loss(model, config, step: int) -> float:
    """transformers' mean loss of `model` on step `step`'s global batch of the job `config` (what trainyard's first
    step reports when it starts from the same weights)."""
    import torch.nn.functional as F
    from trainyard.parallel.data.datasets import load_batch, open_dataset
    from trainyard.parallel.data.sampler import global_batch_ids

    dataset = open_dataset(config)
    inputs, targets = load_batch(dataset, global_batch_ids(config.seed, step, config.global_batch,
                                                           dataset.num_samples))
    with torch.no_grad():
        logits = model(inputs).logits
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


TINY_SIZES = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64, "head_dim": 8,
              "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
"""Sizes any transformers config takes (its attribute_map spells them its own way), for the architecture sweep."""
NOT_DEFAULT = {
    "granite": {"logits_scaling": 8.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0156},
    "granitemoe": {"logits_scaling": 8.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22},
    "cohere": {"logit_scale": 0.25},
    "gemma2": {"final_logit_softcapping": 3.0, "sliding_window": 8},
}
"""Fields that change the numbers, away from their defaults (which are often 1 or off), so a skipped one shows."""


MAX_TINY_ELEMENTS = 3_000_000
"""An architecture whose config ignores `TINY_SIZES` (its own fixed widths) is no tiny model."""


def tiny_architecture(model_type: str, directory: Path, *, seed: int = 0):
    """A tiny model of any `AutoModelForCausalLM` architecture, built from transformers' own config class at
    `TINY_SIZES` (and `NOT_DEFAULT`'s fields) and saved; raises what transformers raises when it cannot build or
    run it, and ValueError when the model is not tiny (counted on the meta device first)."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **TINY_SIZES, **NOT_DEFAULT.get(model_type, {}))
    with torch.device("meta"):
        elements = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if elements > MAX_TINY_ELEMENTS:
        raise ValueError(f"{elements} parameters at TINY_SIZES: its config keeps widths of its own")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers' own forward runs at these sizes (some need sizes of their own)
        model(torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    return _saved(model, directory)
