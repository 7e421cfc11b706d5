"""Causal attention over a context-parallel group, by a ring of key/value blocks (written by hand; see below).

Every rank holds the queries, keys and values of its own tokens (`chunks`: two chunks of the sequence, head-tail).
The forward makes cp steps: at step s a rank holds the key/value block of rank (me - s) mod cp, starts sending it on
to the next rank and receiving the next block from the previous one (`batch_isend_irecv`), computes its queries'
attention against the block it holds while the transfer runs, and merges that partial result into its running one
by their log-sum-exp (`merge`). The mask of each block is read by global token index (`Mask`): causal, Mistral's
sliding window and packed examples' segments, so a block that is wholly masked is skipped and every query row
keeps its diagonal (in the rank's own block). The backward is the same ring again (flash attention's backward,
block by block, from the saved output and log-sum-exp): keys and values travel with the gradient accumulators
of their keys and values, which reach their owner after one more step. Grouped-query attention sends the
n_kv_head heads and repeats them per block; their gradients are summed back per group.

Why by hand: torch's `torch.distributed.tensor.experimental.context_parallel` (torch 2.13) does not run here. On
CPU (gloo) the attention dispatches to `aten._scaled_dot_product_flash_attention_for_cpu`, which has no sharding
strategy ("does not have a sharding strategy registered"), and on CUDA its ring takes `is_causal` only, no
`attn_mask`, so Mistral's window and packed examples' document masks cannot pass through it. The blocks here are
computed in fp32 with plain matmuls (memory O(t_local x t_local) per block), exact on every backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from trainyard.parallel.runtime.cp.chunks import local_indices


@dataclass(eq=False)
class Mask:
    """Which (query, key) pairs may attend, by global index: causal, within `window` tokens behind (None: all) and,
    for packed rows, within one segment."""

    indices: list[torch.Tensor]
    """Each cp rank's tokens' global indices (index = cp coordinate)."""
    segments: torch.Tensor | None = None
    """(batch, seq) the whole rows' segments (packed examples), or None."""
    window: int | None = None
    _blocks: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict, repr=False)

    def block(self, q_rank: int, k_rank: int) -> torch.Tensor | None:
        """(batch or 1, 1, t_q, t_k) bool for rank q_rank's queries against rank k_rank's keys; None when nothing
        is allowed (the block is skipped)."""
        key = (q_rank, k_rank)
        if key not in self._blocks:
            qi, kj = self.indices[q_rank], self.indices[k_rank]
            behind = qi.unsqueeze(1) - kj.unsqueeze(0)
            allowed = behind >= 0 if self.window is None else (behind >= 0) & (behind < self.window)
            allowed = allowed.unsqueeze(0)
            if self.segments is not None:
                sq, sk = self.segments[:, qi], self.segments[:, kj]
                allowed = allowed & (sq.unsqueeze(2) == sk.unsqueeze(1))
            self._blocks[key] = allowed.unsqueeze(1) if bool(allowed.any()) else None
        return self._blocks[key]


@dataclass(eq=False)
class ContextShard:
    """One micro-batch's split over a cp group, as the attention modules read it (`Documents.context`)."""

    group: dist.ProcessGroup | None
    ranks: list[int]
    """The cp group's global ranks, index = cp coordinate."""
    cp_rank: int
    seq_len: int
    segments: torch.Tensor | None = None
    """(batch, seq_len) the whole rows' segments when the examples are packed."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _masks: dict[int | None, Mask] = field(default_factory=dict, repr=False)

    @property
    def cp(self) -> int:
        return len(self.ranks)

    def mask(self, window: int | None) -> Mask:
        if window not in self._masks:
            indices = [local_indices(self.seq_len, r, self.cp).to(self.device) for r in range(self.cp)]
            self._masks[window] = Mask(indices, self.segments, window)
        return self._masks[window]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """(batch, heads, t_local, head_dim) q, (batch, kv_heads, t_local, head_dim) k and v: this rank's queries'
        attention over the whole sequences of the group."""
        return RingAttention.apply(q, k, v, self, self.mask(window))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of q against one key block, k and v with q's heads: (output, log-sum-exp of each row); a row
    with no allowed key has output 0 and log-sum-exp -inf."""
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return p @ v, lse


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, as one: weighted by exp(lse - new lse)."""
    new = torch.logaddexp(lse, lse_b)
    safe = _finite(new)
    wa, wb = torch.exp(lse - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    return out * wa + out_b * wb, new


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradients of repeated kv heads summed back to each kv head."""
    if groups == 1:
        return dx
    b, h, t, d = dx.shape
    return dx.view(b, h // groups, groups, t, d).sum(2)


class _Ring:
    """Blocks passed to the next rank of the group while the current one is computed."""

    def __init__(self, shard: ContextShard):
        me, n = shard.cp_rank, shard.cp
        self.next, self.prev, self.group = shard.ranks[(me + 1) % n], shard.ranks[(me - 1) % n], shard.group

    def start(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


class RingAttention(torch.autograd.Function):
    """Ring attention's forward and backward (module doc); q, k, v as `ContextShard.attend` takes them."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ContextShard,
                mask: Mask) -> torch.Tensor:
        dtype, groups = q.dtype, q.shape[1] // k.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            qf, kf, vf = q.float(), k.float().contiguous(), v.float().contiguous()
            b, h, t, d = qf.shape
            out = torch.zeros_like(qf)
            lse = torch.full((b, h, t), float("-inf"), device=q.device)
            ring, blocks = _Ring(shard), [kf, vf]
            for s in range(shard.cp):
                works: list = []
                if s < shard.cp - 1:
                    nxt, works = ring.start(blocks)
                allowed = mask.block(shard.cp_rank, (shard.cp_rank - s) % shard.cp)
                if allowed is not None:
                    o, l_b = block_attention(qf, _repeat(blocks[0], groups), _repeat(blocks[1], groups), allowed)
                    out, lse = merge(out, lse, o, l_b)
                ring.wait(works)
                if s < shard.cp - 1:
                    blocks = nxt
        ctx.save_for_backward(qf, kf, vf, out, lse)
        ctx.shard, ctx.mask, ctx.dtype = shard, mask, dtype
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        qf, kf, vf, out, lse = ctx.saved_tensors
        shard, mask = ctx.shard, ctx.mask
        groups, scale = qf.shape[1] // kf.shape[1], 1.0 / math.sqrt(qf.shape[-1])
        with torch.autocast(qf.device.type, enabled=False):
            do = dout.float()
            delta = (do * out).sum(-1, keepdim=True)
            dq = torch.zeros_like(qf)
            ring, kv = _Ring(shard), [kf, vf]
            dkv = [torch.zeros_like(kf), torch.zeros_like(vf)]
            for s in range(shard.cp):
                works: list = []
                if s < shard.cp - 1:
                    nxt, works = ring.start(kv)
                allowed = mask.block(shard.cp_rank, (shard.cp_rank - s) % shard.cp)
                if allowed is not None:
                    ke, ve = _repeat(kv[0], groups), _repeat(kv[1], groups)
                    scores = (qf @ ke.transpose(-1, -2)) * scale
                    p = torch.exp(scores - _finite(lse).unsqueeze(-1)).masked_fill(~allowed, 0.0)
                    dv = p.transpose(-1, -2) @ do
                    ds = p * (do @ ve.transpose(-1, -2) - delta)
                    dq += (ds @ ke) * scale
                    dk = (ds.transpose(-1, -2) @ qf) * scale
                    dkv = [dkv[0] + _fold(dk, groups), dkv[1] + _fold(dv, groups)]
                ring.wait(works)
                # The accumulators follow their block: after the last step one more shift brings each home.
                dkv, moved = ring.start(dkv)
                ring.wait(moved)
                if s < shard.cp - 1:
                    kv = nxt
        return dq.to(ctx.dtype), dkv[0].to(ctx.dtype), dkv[1].to(ctx.dtype), None, None
