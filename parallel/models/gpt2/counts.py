"""GPT-2's memory counting: exact parameters of a stage, and the bytes its modules keep for backward.

Parameters are counted from the shapes as `parallel.models.gpt2.model` builds them and its tensor-parallel
plan shards them. Activations are the tensors each op saves, read off the pipeline's saved-tensor meter on
CPU (torch 2.13) and written out term by term (see `parallel.plan.memory.estimate` for how they add up over a schedule).
Pure arithmetic: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.counting import (
    BF16,
    FP32,
    INDEX,
    LN_STATS,
    ParamCounts,
    Shapes,
    head_and_loss,
    moe_routing,
)


def ffn_hidden(m: ModelConfig) -> int:
    return m.ffn_hidden or 4 * m.d_model


def param_counts(m: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int, ep: int) -> ParamCounts:
    d, vocab, f = m.d_model, m.vocab_size, ffn_hidden(m)
    local_experts = m.experts // ep if m.moe else 0
    dense = router = experts = 0
    if first:
        dense += vocab * d // tp + m.context * d  # wte split over the vocabulary, wpe replicated
    for block in layers:
        # two LayerNorms (4d); q, k, v column-parallel (weight and bias / tp); attn.proj row-parallel (bias
        # replicated)
        dense += 4 * d + 3 * (d * d + d) // tp + d * d // tp + d
        if m.is_moe_block(block):
            router += d * m.experts  # no bias, not sharded
            experts += local_experts * (d * f + f + f * d + d)  # whole experts on every tp rank
        else:
            dense += (d * f + f) // tp + f * d // tp + d  # fc column-, proj row-parallel
    if last:
        dense += 2 * d + (0 if m.tie_embeddings and first else vocab * d // tp)
    return ParamCounts(dense=dense, router=router, experts=experts)


def matrices(m: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int, ep: int) -> list:
    """(rows, cols, set) of each local weight matrix, as `param_counts` counts them (Linear weights: out x in)."""
    d, vocab, f = m.d_model, m.vocab_size, ffn_hidden(m)
    out: list = []
    if first:
        out += [(vocab // tp, d, "dense"), (m.context, d, "dense")]
    for block in layers:
        out += [(d // tp, d, "dense")] * 3 + [(d, d // tp, "dense")]
        if m.is_moe_block(block):
            out.append((m.experts, d, "router"))
            out += [(f, d, "experts"), (d, f, "experts")] * (m.experts // ep)
        else:
            out += [(f // tp, d, "dense"), (d, f // tp, "dense")]
    if last and not (m.tie_embeddings and first):
        out.append((vocab // tp, d, "dense"))
    return out


def embed_activations(m: ModelConfig, s: Shapes) -> int:
    return INDEX * s.tokens + INDEX * m.seq_len  # wte keeps the token ids, wpe the positions


def attention(s: Shapes) -> int:
    """ln_1 and the attention of one block."""
    d = s.d
    ln = s.stream * (FP32 * d + LN_STATS)  # ln_1's input
    # The region's input (ln_1's output, all-gathered over tp under sp), kept by q, k and v: one fp32 tensor,
    # or under autocast one bf16 copy each.
    region_input = s.tokens * (3 * BF16 * d if s.bf16 else FP32 * d)
    # q, k, v and the attention output (which attn.proj keeps as its input too), d / tp wide each, and the
    # log-sum-exp of every head (fp32).
    core = s.tokens * (s.act * 4 * d // s.tp + FP32 * s.heads)
    weights = BF16 * 4 * d * d // s.tp if s.bf16 else 0  # autocast's bf16 copies of q, k, v, proj weights
    return ln + region_input + core + weights


def block_activations(m: ModelConfig, block: int, s: Shapes) -> tuple[int, int, int]:
    return moe_block(m, s) if m.is_moe_block(block) else dense_block(m, s)


def dense_block(m: ModelConfig, s: Shapes) -> tuple[int, int, int]:
    """(bytes kept with no checkpointing, bytes selective checkpointing saves, its recomputed region's bytes)."""
    d, f = s.d, ffn_hidden(m)
    ln_2 = s.stream * (FP32 * d + LN_STATS)
    mlp_input = s.tokens * s.act * d  # ln_2's output (its bf16 copy under autocast), kept by fc
    hidden = s.tokens * s.act * f // s.tp  # fc's output (kept by GELU) and GELU's (kept by proj) each
    weights = BF16 * 2 * d * f // s.tp if s.bf16 else 0
    full = attention(s) + ln_2 + mlp_input + 2 * hidden + weights
    # selective: GELU with proj is recomputed (GELU's output and, under autocast, proj's bf16 weight are not
    # kept), and so is the attention core (its log-sum-exp; q, k, v and the output are kept anyway)
    proj_weight = BF16 * d * f // s.tp if s.bf16 else 0
    saving = hidden + proj_weight + s.tokens * FP32 * s.heads
    return full, saving, hidden + proj_weight


def moe_block(m: ModelConfig, s: Shapes) -> tuple[int, int, int]:
    """As `dense_block`, for a mixture-of-experts block: attention, ln_2, router and this rank's experts."""
    moe, d, f = m.moe, s.d, ffn_hidden(m)
    assert moe is not None, "an MoE block's model has experts"
    n_local = moe.experts // s.ep
    ln_2 = s.stream * (FP32 * d + LN_STATS)
    # Per routed row: the row going into its expert (a bf16 copy under autocast), the expert's hidden before
    # and after GELU (ffn_hidden each), its output and the gate-weighted output (fp32), and the row's gate
    # weight and indices (which rows were kept, their order, their token; with ep also their order on arrival).
    rows, router = moe_routing(m, s)
    hidden = rows * s.act * f
    per_row = s.act * d + 2 * FP32 * d + FP32 + 3 * INDEX + (INDEX if s.ep > 1 else 0)
    weights = BF16 * (d * moe.experts + n_local * 2 * d * f) if s.bf16 else 0
    full = attention(s) + ln_2 + router + rows * per_row + 2 * hidden + weights
    proj_weights = BF16 * n_local * d * f if s.bf16 else 0
    saving = hidden + proj_weights + s.tokens * FP32 * s.heads
    region = math.ceil(hidden / max(n_local, 1)) + (BF16 * d * f if s.bf16 else 0)  # one expert's GELU
    return full, saving, region


def head_activations(m: ModelConfig, s: Shapes) -> int:
    """ln_f, the output head and the loss of one micro-batch."""
    ln_f = s.stream * (FP32 * s.d + LN_STATS)
    return ln_f + head_and_loss(m, s)
