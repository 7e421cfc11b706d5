"""Qwen3's attention: llama's, with an RMSNorm over each head of q and of k before the rotation (transformers'
`q_norm` and `k_norm`, named `ln_q` and `ln_k` here so they start at 1 as every trainyard norm does)."""

from __future__ import annotations

import torch
from torch import nn
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.llama.layers import LlamaAttention


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.ln_q = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)
        self.ln_k = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().heads(x)
        return self.ln_q(q), self.ln_k(k), v
