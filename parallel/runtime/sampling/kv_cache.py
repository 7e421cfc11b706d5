"""The model as generation calls it: `prefill` the prompt once, then `step` one token per sequence at a time, each
reusing the keys and values of every position before it (a KV cache), with `expand` (the prompt's cache copied
for each sample) and `select` (only the sequences still running kept).

- The native families (`parallel.models.components.decoder.DecoderStage`): the stage's own modules (embedding,
  each block's norms, q/k/v/output projections with their LoRA hooks, feed-forward or MoE, final norm and head),
  stepped here with cached keys and values, because their attention has no cache path of its own. Llama's
  attention and its kin (qwen2, qwen3's q/k norms through `heads`, mistral's sliding window as a mask) rotate q and
  k at the positions after the cache; gpt2's adds its learned position embeddings at those positions.
- The transformers backend (`parallel.models.hf.HFStage`): the model's body with its own cache
  (`cache`, `use_cache=True`: transformers' `DynamicCache`, sliding windows and all; transformers >= 5.24, as
  the backend needs), then its head.
- Any other stage (an attention this module does not know): `Recompute`, the whole sequence through the stage's
  forward each token (no cache, the same numbers, more work).

Logits come back in fp32, for the positions asked: at a prefill, from `first` on (the prompt's scored positions and
the last one), at a step the one new position. The rank's autocast (`autocast`) wraps every forward, as its
training forward's does, so a sample's logprobs are the training forward's. Everything runs under `no_grad`. Under
tensor parallelism every rank of the group steps the same sequences, each its own heads (the styles' collectives
run as in training), and the head's vocabulary-sharded logits are gathered whole (`whole`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from trainyard.parallel.models.gpt2.layers import CausalSelfAttention
from trainyard.parallel.models.llama.layers import LlamaAttention, rotate_half

Autocast = Callable[[], contextlib.AbstractContextManager]


class CachedModel(Protocol):
    def prefill(self, tokens: torch.Tensor, first: int = -1) -> torch.Tensor:
        """(1, t) prompt ids -> (1, t - first, vocab) fp32 logits of positions first.. (-1: the last one only)."""
        ...

    def expand(self, n: int) -> None:
        """The cache of one sequence copied for `n`."""
        ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b, 1) the next token of each sequence -> (b, vocab) fp32 logits of the position after it."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these sequences (indices into the current batch), in this order."""
        ...


def cached_model(stage: nn.Module, autocast: Autocast = contextlib.nullcontext) -> CachedModel:
    """The right cached model for a built stage (one that is first and last: the whole model)."""
    if hasattr(stage, "body") and hasattr(stage, "logits"):  # the transformers backend's HFStage
        return HFCache(stage, autocast)
    blocks = getattr(stage, "blocks", None)
    if blocks is not None and all(isinstance(b.attn, LlamaAttention | CausalSelfAttention) for b in blocks.values()):
        return NativeCache(stage, autocast)
    return Recompute(stage, autocast)


def whole(logits: torch.Tensor) -> torch.Tensor:
    """The logits over the whole vocabulary: under tp the head's output is sharded over it (a DTensor), gathered
    here, so every rank of the group draws from the same numbers."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _first(first: int, t: int) -> int:
    return t - 1 if first < 0 else first


class NativeCache:
    """A native family's stage stepped with cached keys and values (see the module's docstring)."""

    def __init__(self, stage: Any, autocast: Autocast = contextlib.nullcontext):
        self.stage, self.autocast = stage, autocast
        self.blocks = list(stage.blocks.values())
        self.keys: list[torch.Tensor | None] = [None] * len(self.blocks)
        self.values: list[torch.Tensor | None] = [None] * len(self.blocks)
        self.length = 0

    def prefill(self, tokens: torch.Tensor, first: int = -1) -> torch.Tensor:
        return self._forward(tokens, _first(first, tokens.shape[1]))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens, 0)[:, -1]

    def expand(self, n: int) -> None:
        self.keys = [None if k is None else k.expand(n, -1, -1, -1).contiguous() for k in self.keys]
        self.values = [None if v is None else v.expand(n, -1, -1, -1).contiguous() for v in self.values]

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]

    @torch.no_grad()
    def _forward(self, tokens: torch.Tensor, first: int) -> torch.Tensor:
        stage, t = self.stage, tokens.shape[1]
        positions = torch.arange(self.length, self.length + t, device=tokens.device)
        with self.autocast():
            if hasattr(stage, "wpe"):  # gpt2's learned positions, at the positions after the cache
                x = stage.wte(tokens) + stage.wpe(positions)
            else:
                x = stage.embed(tokens)
            for i, block in enumerate(self.blocks):
                x = x + self._attention(i, block.attn, block.ln_1(x), positions)
                x = x + (block.moe if block.is_moe else block.mlp)(block.ln_2(x))
            logits = stage.lm_head(stage.ln_f(x[:, first:]))
        self.length += t
        return whole(logits).float()

    def _attention(self, i: int, attn: Any, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        if isinstance(attn, LlamaAttention):
            q, k, v = (h.transpose(1, 2) for h in attn.heads(x))
            cos, sin = (c.to(q.dtype) for c in attn._rotation(t, x.device, positions.expand(b, t)))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            window = attn.window
        else:  # gpt2's
            q, k, v = (lin(x).view(b, t, -1, attn.head_dim).transpose(1, 2) for lin in (attn.q, attn.k, attn.v))
            window = None
        cached_k, cached_v = self.keys[i], self.values[i]
        if cached_k is not None and cached_v is not None:
            k, v = torch.cat((cached_k, k), dim=2), torch.cat((cached_v, v), dim=2)
        self.keys[i], self.values[i] = k, v
        gqa = k.shape[1] != q.shape[1]
        if k.shape[2] == t and window is None:  # the prompt: causal over itself, as the training forward runs it
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # query at position p sees keys j <= p (and p - window < j)
            behind = positions[:, None] - torch.arange(k.shape[2], device=x.device)[None, :]
            mask = (behind >= 0) & (behind < (window if window is not None else k.shape[2] + t))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return attn.proj(y.transpose(1, 2).reshape(b, t, -1))


class HFCache:
    """The transformers backend's stage: its body with transformers' own cache, then the model's head."""

    def __init__(self, stage: Any, autocast: Autocast = contextlib.nullcontext):
        self.stage, self.autocast = stage, autocast
        self.cache: Any = None

    @torch.no_grad()
    def _forward(self, tokens: torch.Tensor, first: int) -> torch.Tensor:
        with self.autocast():
            out = self.stage.body(input_ids=tokens, cache=self.cache, use_cache=True)
            self.cache = out.cache
            logits = self.stage.logits(out.last_hidden_state[:, first:])
        return logits.float()

    def prefill(self, tokens: torch.Tensor, first: int = -1) -> torch.Tensor:
        return self._forward(tokens, _first(first, tokens.shape[1]))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens, 0)[:, -1]

    def expand(self, n: int) -> None:
        self.cache.batch_repeat_interleave(n)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)


class Recompute:
    """No cache: every step runs the whole sequence through the stage's forward (a stage this module cannot
    step: the same logits, more work)."""

    def __init__(self, stage: Any, autocast: Autocast = contextlib.nullcontext):
        self.stage, self.autocast = stage, autocast
        self.tokens: torch.Tensor | None = None

    @torch.no_grad()
    def _logits(self, first: int) -> torch.Tensor:
        assert self.tokens is not None
        stage = self.stage
        with self.autocast():
            hidden = stage(self.tokens)[:, first:]
            head = getattr(stage, "logits", None)
            logits = head(hidden) if head is not None else stage.lm_head(stage.ln_f(hidden))
        return whole(logits).float()

    def prefill(self, tokens: torch.Tensor, first: int = -1) -> torch.Tensor:
        self.tokens = tokens
        return self._logits(_first(first, tokens.shape[1]))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.tokens is not None
        self.tokens = torch.cat((self.tokens, tokens), dim=1)
        return self._logits(self.tokens.shape[1] - 1)[:, -1]

    def expand(self, n: int) -> None:
        assert self.tokens is not None
        self.tokens = self.tokens.expand(n, -1).contiguous()

    def select(self, rows: torch.Tensor) -> None:
        assert self.tokens is not None
        self.tokens = self.tokens[rows]
