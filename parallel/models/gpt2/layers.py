"""GPT-2's dense building blocks: causal self-attention (with biases) and the GELU MLP.

The MLP is also what an MoE block's experts are in this family (`parallel.models.components.moe` asks the family).

Selective activation checkpointing (`recompute = True`, set by `set_activation_checkpointing`) recomputes
in backward what is large to keep and cheap to compute again, with torch's non-reentrant `checkpoint`: the
attention core (what scaled_dot_product_attention keeps for its backward beyond q, k and v: the attention
matrix on its math path, the log-sum-exp on the flash path), and the MLP's activation. The activation's
output is what the output projection keeps for its backward (ffn_hidden per token, the largest activation
of a block), so the checkpointed region is the activation with that projection: its matmul runs twice, the
price of not keeping the activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.components.documents import Documents, attend
from trainyard.parallel.models.components.grouped import grouped_linear


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
        self.recompute = False
        self.documents: Documents | None = None
        """Packed examples (`parallel.models.components.documents`): attention stays within each."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        mask = None if self.documents is None else self.documents.mask()
        if self.recompute:
            y = checkpoint(attend, q, k, v, mask, use_reentrant=False)
        else:
            y = attend(q, k, v, mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, hidden)
        self.proj = nn.Linear(hidden, cfg.d_model)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return checkpoint(self._activate, h, use_reentrant=False) if self.recompute else self._activate(h)

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(h, approximate=self.approximate))

    @staticmethod
    def grouped(experts: list[MLP], rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Experts' rows (sorted by expert, `offs` where each one's end) through them in two grouped matmuls
        (`parallel.models.components.grouped`)."""
        h = grouped_linear(rows, [e.fc.weight for e in experts], offs, [e.fc.bias for e in experts])
        h = F.gelu(h, approximate=experts[0].approximate)
        return grouped_linear(h, [e.proj.weight for e in experts], offs, [e.proj.bias for e in experts])
