"""Llama's building blocks: rotary embeddings, grouped-query attention and the SwiGLU MLP; no biases.

Rotary embeddings follow Hugging Face's Llama convention (`rotate_half` on the two halves of each head, not
interleaved pairs), so its q and k weights map without permutation. cos and sin are computed in fp32 from the
positions of the whole sequence: with sequence parallelism the attention's input is all-gathered before q,
k and v, so every tensor-parallel rank holds every position of its heads. Llama 3's rope scaling reshapes
the frequencies once, at construction.

Grouped-query attention: k and v have n_kv_head heads, each shared by n_head / n_kv_head query heads (query
head h reads kv head h // (n_head / n_kv_head), as transformers' `repeat_kv`); tensor parallelism keeps
n_head / tp query and n_kv_head / tp kv heads per rank, which pair up the same way.

Selective activation checkpointing (`recompute`) recomputes the attention core and the SwiGLU product with
the down projection, as gpt2's layers do (see `parallel.models.gpt2.layers`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from trainyard.parallel.config import ModelConfig, RopeScalingConfig
from trainyard.parallel.models.components.decoder import causal_attention
from trainyard.parallel.models.components.documents import Documents, attend
from trainyard.parallel.models.components.grouped import grouped_linear


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig | None) -> torch.Tensor:
    """The inverse frequencies of each pair of a head's dimensions (fp32, as transformers computes them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # transformers' _compute_llama3_parameters
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    """Causal self-attention with rotary positions and n_kv_head key/value heads of `head_size` each; no
    biases unless `QKV_BIAS` (Qwen2's); over the whole causal context, or the last `sliding_window` positions
    (Mistral's)."""

    QKV_BIAS = False
    """q, k and v carry biases (qwen2 sets it)."""
    inv_freq: torch.Tensor
    """A buffer (`register_buffer` in __init__)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_size
        q, kv = cfg.n_head * self.head_dim, (cfg.n_kv_head or cfg.n_head) * self.head_dim
        self.q = nn.Linear(cfg.d_model, q, bias=self.QKV_BIAS)
        self.k = nn.Linear(cfg.d_model, kv, bias=self.QKV_BIAS)
        self.v = nn.Linear(cfg.d_model, kv, bias=self.QKV_BIAS)
        self.proj = nn.Linear(q, cfg.d_model, bias=False)
        self.window = cfg.sliding_window
        # Not a parameter, and not persistent: no part of a checkpoint; derived from the config alone.
        self.rope = (cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", rope_frequencies(self.head_dim, *self.rope), persistent=False)
        self.recompute = False
        self.documents: Documents | None = None
        """Packed examples (`parallel.models.components.documents`): positions restart at each, attention stays within
        it."""

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of `x` as (batch, seq, heads, head_dim), before rotation (qwen3 normalises q and k here)."""
        b, t = x.shape[:2]
        q, k, v = (lin(x).view(b, t, -1, self.head_dim) for lin in (self.q, self.k, self.v))
        return q, k, v

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """`inv_freq` again (after `to_empty`, on a stage built on the meta device), computed on the CPU as at
        construction and copied to the buffer's device."""
        self.inv_freq.copy_(rope_frequencies(self.head_dim, *self.rope))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        q, k, v = (h.transpose(1, 2) for h in self.heads(x))
        docs = self.documents
        positions = None if docs is None else docs.positions
        cos, sin = (c.to(q.dtype) for c in self._rotation(t, x.device, positions))  # bf16 under autocast, as q is
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if docs is not None and docs.context is not None:  # context parallelism: the ring over the cp group
            ring = docs.context.attend
            # selective recompute re-runs the ring in backward (every rank of the group at the same point)
            y = checkpoint(ring, q, k, v, self.window, use_reentrant=False) if self.recompute else \
                ring(q, k, v, self.window)
            return self.proj(y.transpose(1, 2).reshape(b, t, -1))
        mask = None if docs is None else docs.mask(self.window)
        if self.recompute:
            y = checkpoint(self._attend, q, k, v, mask, use_reentrant=False)
        else:
            y = self._attend(q, k, v, mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """`mask`: packed examples' (`Documents.mask`, the window included), else causal and the window here."""
        t = q.shape[2]
        if mask is not None:
            return attend(q, k, v, mask)
        if self.window is None or self.window >= t:
            return causal_attention(q, k, v)
        # Mistral's sliding window, as transformers masks it: query i sees keys j with i - window < j <= i.
        # The whole sequence is here (with sp the attention's input is all-gathered), so the mask is exact.
        pos = torch.arange(t, device=q.device)
        behind = pos.unsqueeze(1) - pos.unsqueeze(0)
        mask = (behind >= 0) & (behind < self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])

    def _rotation(self, t: int, device: torch.device, positions: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's angles, fp32 also under autocast: (t, head_dim) for positions 0..t-1,
        or (batch, 1, t, head_dim) for packed examples' (batch, t) `positions`."""
        with torch.autocast(device.type, enabled=False):
            if positions is None:
                freqs = torch.outer(torch.arange(t, device=device, dtype=torch.float32), self.inv_freq.float())
            else:
                freqs = (positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.float()).unsqueeze(1)
            angles = torch.cat((freqs, freqs), dim=-1)
            return angles.cos(), angles.sin()


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); no biases. Also each expert of an MoE block (Mixtral's shape)."""

    def __init__(self, cfg: ModelConfig, hidden: int):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)
        self.recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate(x), self.up(x)
        return checkpoint(self._activate, g, u, use_reentrant=False) if self.recompute else self._activate(g, u)

    def _activate(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(g) * u)

    @staticmethod
    def grouped(experts: list[SwiGLU], rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Experts' rows (sorted by expert, `offs` where each one's end) through them in three grouped matmuls
        (`parallel.models.components.grouped`)."""
        g = grouped_linear(rows, [e.gate.weight for e in experts], offs)
        u = grouped_linear(rows, [e.up.weight for e in experts], offs)
        return grouped_linear(F.silu(g) * u, [e.down.weight for e in experts], offs)
