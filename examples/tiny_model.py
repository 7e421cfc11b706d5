"""A tiny Hugging Face Llama with random weights (byte-level: 256 ids), saved with `save_pretrained`, for the Tinker
examples on a laptop: `python examples/tiny_model.py DIR` (nothing is downloaded).

Serve it under a name (`trainyard serve --base-model tiny-llama=DIR`) or put DIR under your data roots.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def save_tiny_llama(directory: str | Path, seed: int = 0) -> Path:
    """Weights drawn wider than transformers' default (std 0.2, not 0.02): LoRA leaves the head and the final norm
    as they are, and at std 0.02 their logits could not leave a band about 1.3 wide (the loss stays near ln 256)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(directory)
    return Path(directory)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    print(save_tiny_llama(parser.parse_args().directory))
