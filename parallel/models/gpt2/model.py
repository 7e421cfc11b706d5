"""The GPT-2 decoder: LayerNorm, learned positions, GELU MLP, biases (numerics as before the families).

A stage of it is a `parallel.models.components.decoder.DecoderStage` with these parts; see there for what a stage holds
and offers.
"""

from __future__ import annotations

import torch
from torch import nn
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.models.gpt2.counts import ffn_hidden
from trainyard.parallel.models.gpt2.layers import MLP, CausalSelfAttention


class GPTStage(DecoderStage):
    """A contiguous run of GPT-2 blocks, plus the embeddings on the first stage and the head on the last."""

    @staticmethod
    def norm(cfg: ModelConfig) -> nn.Module:
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    @staticmethod
    def attention(cfg: ModelConfig) -> nn.Module:
        return CausalSelfAttention(cfg)

    @staticmethod
    def feed_forward(cfg: ModelConfig) -> nn.Module:
        return MLP(cfg, ffn_hidden(cfg))

    def build_embeddings(self, cfg: ModelConfig) -> None:
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token plus learned position embeddings of (batch, seq) token ids: positions 0..seq-1, or packed
        examples' (restarting at each; not with sp, whose `wpe` style slices a (seq, d_model) output)."""
        if self.documents is not None:
            return self.wte(tokens) + self.wpe(self.documents.positions)
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)
