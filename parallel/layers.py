"""The dense building blocks of the GPT: causal self-attention and the GELU MLP.

Shared by the dense block (`parallel.model`) and the mixture-of-experts layer (`parallel.moe`), whose
experts are this same MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.config import ModelConfig


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k and v projections.

    Separate (not one fused 3 x d_model) projections so tensor parallelism can split each by heads with a
    plain column split; the forward therefore counts heads from its input (-1), never from the config.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))
