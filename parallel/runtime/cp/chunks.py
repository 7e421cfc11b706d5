"""Which tokens of a sequence a context-parallel rank holds, and a micro-batch sliced to them.

A sequence of T tokens is cut into 2 x cp equal chunks; rank i of the cp group holds chunks i and 2cp-1-i
(head-tail load balancing, torchtitan's and Megatron's): under a causal mask chunk c attends to c + 1 chunks' keys,
so every rank does (i + 1) + (2cp - i) = 2cp + 1 chunk-pairs of attention work, the same on all. Every token keeps
its global index: the rotary positions (or a packed example's positions) and the causal, window and document masks
are all read by global index, so the split changes no number.
"""

from __future__ import annotations

import torch


def rank_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) rank `cp_rank` holds: head chunk i and its mirror 2cp-1-i."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is outside a cp group of {cp}")
    return cp_rank, 2 * cp - 1 - cp_rank


def local_indices(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """The global indices (int64, ascending) of the seq_len / cp tokens rank `cp_rank` holds."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2 x cp = {2 * cp}")
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in rank_chunks(cp_rank, cp)])


def attention_work(seq_len: int, cp_rank: int, cp: int) -> int:
    """(query, key) pairs a rank's causal attention computes: the balance head-tail splitting buys."""
    idx = local_indices(seq_len, cp_rank, cp)
    return int((idx + 1).sum())


def take(x: torch.Tensor, indices: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """`x`'s tokens at `indices` along the sequence dimension `dim` (contiguous, a copy)."""
    return x.index_select(dim, indices.to(x.device)).contiguous()
