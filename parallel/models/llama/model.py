"""The Llama decoder: RMSNorm, rotary positions (in the attention), SwiGLU, grouped-query attention, no
biases; optionally tied embeddings.

A stage of it is a `parallel.models.components.decoder.DecoderStage` with these parts; see there for what a stage holds
and offers. Parameter names (fixed: the Hugging Face mapping relies on them): `wte.weight`,
`blocks.{i}.ln_1.weight`, `blocks.{i}.attn.{q,k,v,proj}.weight`, `blocks.{i}.ln_2.weight`,
`blocks.{i}.mlp.{gate,up,down}.weight`, MoE blocks `blocks.{i}.moe.router.weight` and
`blocks.{i}.moe.experts.{e}.{gate,up,down}.weight`, `ln_f.weight`, `lm_head.weight`.
"""

from __future__ import annotations

import torch
from torch import nn
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.models.llama.counts import ffn_hidden
from trainyard.parallel.models.llama.layers import LlamaAttention, SwiGLU


class LlamaStage(DecoderStage):
    """A contiguous run of Llama blocks, plus the token embedding on the first stage and the head on the last."""

    RESIDUAL = ("proj.weight", "down.weight")

    @staticmethod
    def norm(cfg: ModelConfig) -> nn.Module:
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    @staticmethod
    def attention(cfg: ModelConfig) -> nn.Module:
        return LlamaAttention(cfg)

    @staticmethod
    def feed_forward(cfg: ModelConfig) -> nn.Module:
        return SwiGLU(cfg, ffn_hidden(cfg))

    def build_embeddings(self, cfg: ModelConfig) -> None:
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings of (batch, seq) token ids; positions enter in each attention (rotary)."""
        return self.wte(tokens)
