"""The documents of a packed micro-batch (`data.packing: true`) and the attention they allow.

A packed row holds several whole examples one after the other. Each token carries its example's index in the
row (its segment; the row's padding is one segment of its own) and its position inside that example, which
restarts at 0 at each example. A query attends to a key only when it is not after it (causal), in the same
segment and, with Mistral's sliding window, fewer than `window` tokens behind: so an example sees nothing of
its neighbours, and every row of the mask keeps its diagonal (SDPA returns NaN for a row with no key).

The attention modules (and gpt2's position embedding) read the current micro-batch's `Documents` from an
attribute, `documents`, which `DecoderStage.set_documents` sets on every module that has one: the pipeline
executor calls it before every forward and every backward action of a micro-batch, so a recompute in the
backward (activation checkpointing) and an interleaved schedule read the documents of the micro-batch they
run. Without packing the attribute is None and the modules use their causal path unchanged.

Context parallelism (`parallel.cp`) hands every micro-batch a `Documents` too, packed or not: the positions of the
rank's tokens by global index (or inside their example) and a `context` whose `attend` runs the ring over the cp
group (`parallel.runtime.cp.ring`), which the attention calls instead of building a mask over its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from trainyard.parallel.models.components.transfers import to_device


@dataclass(eq=False)
class Documents:
    """(batch, seq) int64 each: every token's position in its example and its segment (example) in the row."""

    positions: torch.Tensor
    segments: torch.Tensor
    context: AttendsContext | None = None
    """Context parallelism: this rank's share of the sequences, whose attention runs over the cp group."""
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def to(self, device: torch.device) -> Documents:
        return Documents(to_device(self.positions, device), to_device(self.segments, device), self.context)

    def mask(self, window: int | None = None) -> torch.Tensor:
        """(batch, 1, seq, seq) bool, True where query i may attend to key j; computed once per micro-batch
        (every layer, and a recompute, reads the same one)."""
        if window not in self._masks:
            self._masks[window] = document_mask(self.segments, window)
        return self._masks[window]


def document_mask(segments: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Causal, within one segment, and (with a window) query i sees keys j with i - window < j <= i."""
    idx = torch.arange(segments.shape[1], device=segments.device)
    behind = idx.unsqueeze(1) - idx.unsqueeze(0)
    allowed = behind >= 0 if window is None else (behind >= 0) & (behind < window)
    return (allowed & (segments.unsqueeze(2) == segments.unsqueeze(1))).unsqueeze(1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(batch, heads, seq, head_dim) each (k and v may have fewer heads: grouped-query attention): causal without
    a mask, else as `mask` allows."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class AttendsContext(Protocol):
    """Attention over a context-parallel group (`parallel.runtime.cp.ring.ContextShard`)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        ...


@runtime_checkable
class ReadsDocuments(Protocol):
    """A module that reads the current micro-batch's documents (None: not packed)."""

    documents: Documents | None
