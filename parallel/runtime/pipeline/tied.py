"""Tied input and output embeddings across pipeline chunks (Megatron's scheme): two copies kept bitwise equal.

When the embedding (first virtual stage) and the head (last virtual stage) are in different chunks, on two pipeline
ranks or in two chunks of one rank (the V placement), the last stage holds its own copy of the embedding as its
output projection (`DecoderStage.tied_copy`), drawn from the same (seed, name) generator or read from the same
checkpoint tensor. `TiedEmbeddings` keeps the copies equal:
- every step, after the data-parallel reduction and before clipping, each copy's gradient becomes the sum of both
  (`sum_grads`): an all-reduce over the pair of ranks holding them for the same (dp, tp) coordinates
  (`RankGroups.tied`), or a local add when one rank holds both. A sum of two is the same float whichever operand
  comes first, so both copies get bitwise the same gradient, the same clipping factor and the same optimizer
  update. The reduced gradients of the two copies lie alike on their ranks at every ZeRO stage: whole at zero 0;
  one bucket of their own at ZeRO-1 (`own_bucket`, so the reduce-scatter gives the pair the same slice); the same
  FSDP2 dim-0 shard at ZeRO-2/3; the same vocabulary rows under tp (both Shard(0));
- the gradient norm counts the tied weight once (`norm_weight`: the head copy weighs nothing);
- checkpoints see one tensor: the head copy is named by the embedding's name (`state_names`; DCP keeps one of the
  equal copies two ranks write), so a checkpoint written at any pp loads at any other, pp=1 included; where one
  rank holds both, the embedding stands for both and `copy_to_head` rebuilds the copy after a load.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.runtime.tp.local_parts import OWN_BUCKET, local_part


class TiedEmbeddings:
    """The copies of a tied embedding this rank holds (`embedding`, `head`: None where it holds none) and the
    group of the rank holding the other one."""

    def __init__(self, chunks: Sequence[DecoderStage], group: dist.ProcessGroup | None):
        firsts = [c.wte.weight for c in chunks if c.cfg.tie_embeddings and c.first and not c.last]
        self.embedding = cast(nn.Parameter, firsts[0]) if firsts else None
        heads = [c.lm_head.weight for c in chunks if c.tied_copy]
        self.head = cast(nn.Parameter, heads[0]) if heads else None
        self.group = group
        self.name = chunks[0].EMBEDDING

    def mark(self) -> None:
        """Before the reducers are built: each copy's gradient in a bucket of its own."""
        for p in (self.embedding, self.head):
            if p is not None:
                setattr(p, OWN_BUCKET, True)

    @property
    def active(self) -> bool:
        """Whether this rank holds a copy of a tied embedding that another chunk also holds."""
        return self.embedding is not None or self.head is not None

    @property
    def local(self) -> bool:
        """Whether this rank holds both copies (the V placement's rank 0)."""
        return self.embedding is not None and self.head is not None

    @torch.no_grad()
    def sum_grads(self, held: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each copy's reduced gradient (this rank's part of it: `Reducer.held_grads`) becomes the sum of both."""
        held = list(held)
        embedding = [g for g, p in held if p is self.embedding and p is not None]
        head = [g for g, p in held if p is self.head and p is not None]
        if self.local:
            for e, h in zip(embedding, head, strict=True):
                e.add_(h)
                h.copy_(e)
        elif self.group is not None:
            mine = embedding + head
            flat = torch.cat([g.reshape(-1) for g in mine]) if mine else torch.zeros(0)
            dist.all_reduce(flat, group=self.group)  # one collective, whatever pieces this rank holds
            offset = 0
            for g in mine:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def norm_weight(self, p: torch.Tensor) -> float:
        """The head copy's gradient equals the embedding's after `sum_grads`: the norm counts it once."""
        return 0.0 if p is self.head and self.head is not None else 1.0

    def state_names(self, chunks: Sequence[DecoderStage]) -> dict[nn.Parameter, str]:
        """Every parameter of `chunks` under its checkpoint name: the head copy as the embedding (left out where
        the embedding, on this rank, stands for it)."""
        names = {}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if p is self.head and self.head is not None:
                    if self.local:
                        continue
                    name = self.name
                names[p] = name
        return names

    @torch.no_grad()
    def copy_to_head(self, moments: dict[nn.Parameter, dict[str, torch.Tensor]],
                     head_moments: dict[str, torch.Tensor] | None) -> None:
        """After a load where this rank holds both copies: the head copy takes the embedding's value, and its
        moments (`head_moments`, the head's in `moments`' form) the embedding's, from `moments`."""
        if not self.local:
            return
        assert self.embedding is not None and self.head is not None and head_moments is not None
        local_part(self.head).copy_(local_part(self.embedding))
        for key, t in head_moments.items():
            local_part(t).copy_(local_part(moments[self.embedding][key]))
        moments[self.head] = head_moments
