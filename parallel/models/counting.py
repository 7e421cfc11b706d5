"""The vocabulary the families count their memory in: byte sizes, parameter counts, one micro-batch's shapes.

Shared by `parallel.plan.memory.estimate` (which walks a rank's chunks and schedule) and each family's own counting
(`parallel.models.<family>.counts`, which knows what its modules hold and save). Pure arithmetic: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from trainyard.parallel.config import ModelConfig

FP32 = 4
BF16 = 2
INDEX = 8  # int64: token ids, positions, the indices index and topk ops keep
LN_STATS = 2 * FP32  # LayerNorm keeps a mean and a reciprocal std per token


@dataclass(frozen=True)
class ParamCounts:
    """Local parameter elements of a rank, by the group that reduces their gradients."""

    dense: int
    router: int
    experts: int

    @property
    def total(self) -> int:
        return self.dense + self.router + self.experts

    def __add__(self, other: ParamCounts) -> ParamCounts:
        return ParamCounts(self.dense + other.dense, self.router + other.router, self.experts + other.experts)


@dataclass(frozen=True)
class Shapes:
    """One micro-batch on one rank: sizes the activation terms are written in."""

    d: int
    heads: int
    """Attention heads on this rank (n_head / tp)."""
    tokens: int
    """Tokens of the micro-batch (micro_batch_size x seq_len): what the tensor-parallel regions take in."""
    stream: int
    """Tokens of the residual stream this rank holds: tokens / tp with sp, else tokens."""
    tp: int
    bf16: bool
    seq_len: int = 0
    """Tokens of one sequence."""
    ep: int = 1
    """Expert-parallel ranks (the experts this rank hosts: experts / ep)."""

    @property
    def act(self) -> int:
        """Bytes of an element a matmul keeps: its bf16 copy under autocast, else fp32."""
        return BF16 if self.bf16 else FP32


def expert_rows_fraction(m: ModelConfig, tp: int = 1) -> float:
    """Rows the experts compute on per (token, expert) choice: 1 dropless (every choice, sorted by expert); with a
    capacity factor, the fixed-size buffers' rows (`parallel.models.components.moe`): experts x min(capacity, the
    slice's length) per slice of seq_len / tp tokens' x top_k choices, kept or not (more than 1 when capacity x experts
    exceeds the choices)."""
    moe = m.moe
    if moe is None or moe.capacity_factor is None:
        return 1.0
    cap = math.ceil(moe.capacity_factor * m.seq_len * moe.top_k / moe.experts)
    slice_len = max(1, m.seq_len // tp)
    return min(cap, slice_len) * moe.experts / (slice_len * moe.top_k)


def moe_routing(m: ModelConfig, s: Shapes) -> tuple[int, int]:
    """(rows the experts compute on on this rank, bytes the router keeps); the same in every family
    (`parallel.models.components.moe` routes alike whatever the experts are)."""
    moe = m.moe
    assert moe is not None, "routing is an MoE model's"
    routed = s.tokens // s.tp  # each tp rank routes its slice of every sequence
    rows = math.ceil(routed * moe.top_k * expert_rows_fraction(m, s.tp))  # balanced over ep
    # Per routed token: the router's input (ln_2's output slice, or its bf16 copy), its fp32 logits (kept by
    # the z-loss) and probabilities, the top-k values and indices, and the gate sums and log-sum-exp.
    router = routed * (s.act * s.d + 2 * FP32 * moe.experts + moe.top_k * (INDEX + FP32) + 2 * FP32)
    return rows, router


def chunk_tokens(tokens: int, vocab: int, d_model: int) -> int:
    """Tokens per chunk of the fused loss (`parallel.models.components.loss`): d_model (a chunk's logits as big as the
    weight), or more when that would take more than ceil(vocab / d_model) chunks (a chunk's logits as big as the hidden
    states: Liger's rule)."""
    return max(1, d_model, math.ceil(tokens / math.ceil(vocab / d_model)))


def fused_loss_transient(m: ModelConfig, s: Shapes) -> int:
    """The fused loss's bytes at its peak beside what it keeps for backward (`head_and_loss`), in forward, once per
    micro-batch: one chunk's fp32 logits and their log-softmax, the hidden states with ignored rows zeroed (for
    the weight's gradient), the targets' picked log-probabilities, and under autocast the bf16 copies of the head's
    weight and of the hidden states (`parallel.models.components.loss`). The vocabulary-parallel loss (tp > 1): 0, not
    counted. Measured on the CPU (tests/integration/test_memory_peak.py) as the step's peak over its kept bytes."""
    if s.tp != 1:
        return 0
    d, vocab, tokens = s.d, m.vocab_size, s.tokens
    chunk = min(chunk_tokens(tokens, vocab, d), tokens)
    copies = BF16 * (vocab * d + tokens * d) if s.bf16 else 0
    return 2 * FP32 * chunk * vocab + s.act * tokens * d + FP32 * tokens + copies


def head_and_loss(m: ModelConfig, s: Shapes) -> int:
    """What the output head and the loss keep for backward per micro-batch, after the final norm; the same in
    every family (`DecoderStage.loss_sum`). Fused (tp 1, `parallel.models.components.loss`): the gradients it computed
    in forward, the hidden states' (fp32, the norm's output) and the head weight's (fp32), never logits.
    Vocabulary-parallel (tp > 1): the norm's output kept by the head (all-gathered under sp; its bf16 copy
    under autocast), the weight's bf16 copy, cross_entropy's fp32 log-softmax vocab / tp wide, the targets."""
    d, vocab = s.d, m.vocab_size
    if s.tp == 1:
        return s.tokens * FP32 * d + FP32 * vocab * d
    weight = BF16 * vocab * d // s.tp if s.bf16 else 0
    return s.tokens * s.act * d + weight + s.tokens * (FP32 * vocab // s.tp + INDEX) + FP32


T = TypeVar("T")


def by_block_kind(m: ModelConfig, count: Callable[[int], T]) -> Callable[[int], T]:
    """`count(block)` computed once per kind of block (dense, or mixture-of-experts): a family's blocks of one
    kind have the same parameters and activations, and a model of thousands of blocks is counted in the time of
    two (the planner counts many layouts of it)."""
    known: dict[bool, T] = {}

    def of(block: int) -> T:
        kind = m.is_moe_block(block)
        if kind not in known:
            known[kind] = count(block)
        return known[kind]

    return of
