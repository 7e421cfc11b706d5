"""Llama's memory counting: exact parameters of a stage, and the bytes its modules keep for backward.

Parameters are counted from the shapes as `parallel.models.llama.model` builds them and its tensor-parallel
plan shards them. Activations are the tensors each op saves, read off the pipeline's saved-tensor meter on
CPU (torch 2.13) and written out term by term (see `parallel.plan.memory.estimate` for how they add up over a schedule).
Pure arithmetic: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.counting import BF16, FP32, INDEX, ParamCounts, Shapes, head_and_loss, moe_routing


def rms_norm(s: Shapes) -> int:
    """What an RMSNorm keeps per micro-batch (torch 2.13's nn.RMSNorm on CPU, measured): its input, the
    normalised input (kept by the weight's multiply) and one reciprocal root-mean-square per token."""
    return s.stream * (2 * FP32 * s.d + FP32)


def ffn_hidden(m: ModelConfig) -> int:
    """`ffn_hidden`, or Llama's rule: 8 d_model / 3 rounded up to a multiple of 256."""
    if m.ffn_hidden is not None:
        return m.ffn_hidden
    return 256 * math.ceil(int(8 * m.d_model / 3) / 256)


def kv_width(m: ModelConfig) -> int:
    """Width of k (and of v): n_kv_head heads of `head_size` (d_model / n_head unless head_dim says)."""
    return (m.n_kv_head or m.n_head) * m.head_size


def q_width(m: ModelConfig) -> int:
    """Width of q (and of attn.proj's input): n_head heads of `head_size`."""
    return m.n_head * m.head_size


def param_counts(m: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int, ep: int) -> ParamCounts:
    d, vocab, f, kv, q = m.d_model, m.vocab_size, ffn_hidden(m), kv_width(m), q_width(m)
    dense = router = experts = 0
    if first:
        dense += vocab * d // tp  # wte split over the vocabulary
    for block in layers:
        # two RMSNorms (replicated); q and attn.proj d x q, k and v d x kv, all split over tp
        dense += 2 * d + (2 * d * q + 2 * d * kv) // tp
        if m.is_moe_block(block):
            router += d * m.experts
            experts += m.experts // ep * 3 * d * f  # whole experts on every tp rank
        else:
            dense += 3 * d * f // tp  # gate and up column-, down row-parallel
    if last:
        dense += d + (0 if m.tie_embeddings and first else vocab * d // tp)
    return ParamCounts(dense=dense, router=router, experts=experts)


def matrices(m: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int, ep: int) -> list:
    """(rows, cols, set) of each local weight matrix, as `param_counts` counts them (Linear weights: out x in)."""
    d, vocab, f, kv, q = m.d_model, m.vocab_size, ffn_hidden(m), kv_width(m), q_width(m)
    out: list = []
    if first:
        out.append((vocab // tp, d, "dense"))
    for block in layers:
        out += [(q // tp, d, "dense"), (kv // tp, d, "dense"), (kv // tp, d, "dense"), (d, q // tp, "dense")]
        if m.is_moe_block(block):
            out.append((m.experts, d, "router"))
            out += [(f, d, "experts"), (f, d, "experts"), (d, f, "experts")] * (m.experts // ep)
        else:
            out += [(f // tp, d, "dense"), (f // tp, d, "dense"), (d, f // tp, "dense")]
    if last and not (m.tie_embeddings and first):
        out.append((vocab // tp, d, "dense"))
    return out


def embed_activations(m: ModelConfig, s: Shapes) -> int:
    return INDEX * s.tokens  # wte keeps the token ids


def attention(m: ModelConfig, s: Shapes) -> int:
    """ln_1 and the attention of one block."""
    d, kv, q = s.d, kv_width(m), q_width(m)
    ln = rms_norm(s)  # ln_1
    # the region's input (ln_1's output, all-gathered under sp), kept by q, k and v: one fp32 tensor, or under
    # autocast one bf16 copy each
    region_input = s.tokens * (3 * BF16 * d if s.bf16 else FP32 * d)
    # q and k after rotation, v and the attention output (attn.proj's input too), each per rank's heads; the
    # log-sum-exp of every head; cos and sin of the rotation
    core = s.tokens * (s.act * (2 * q + 2 * kv) // s.tp + FP32 * s.heads)
    rotation = 2 * s.seq_len * m.head_size * s.act
    weights = BF16 * (2 * d * q + 2 * d * kv) // s.tp if s.bf16 else 0  # autocast's bf16 weight copies
    return ln + region_input + core + rotation + weights


def block_activations(m: ModelConfig, block: int, s: Shapes) -> tuple[int, int, int]:
    """(bytes kept with no checkpointing, bytes selective checkpointing saves, its recomputed region's bytes)."""
    return moe_block(m, s) if m.is_moe_block(block) else dense_block(m, s)


def dense_block(m: ModelConfig, s: Shapes) -> tuple[int, int, int]:
    d, f = s.d, ffn_hidden(m)
    ln_2 = rms_norm(s)
    mlp_input = s.tokens * (2 * BF16 * d if s.bf16 else FP32 * d)  # ln_2's output, kept by gate and up
    hidden = s.tokens * s.act * f // s.tp  # gate's and up's outputs, silu's and the product each
    weights = BF16 * 3 * d * f // s.tp if s.bf16 else 0
    full = attention(m, s) + ln_2 + mlp_input + 4 * hidden + weights
    # selective: silu, the product and down are recomputed (silu's output, the product and, under autocast,
    # down's bf16 weight are not kept), and the attention core (its log-sum-exp)
    down_weight = BF16 * d * f // s.tp if s.bf16 else 0
    saving = 2 * hidden + down_weight + s.tokens * FP32 * s.heads
    return full, saving, 2 * hidden + down_weight


def moe_block(m: ModelConfig, s: Shapes) -> tuple[int, int, int]:
    """As `dense_block`, for a mixture-of-experts block: attention, ln_2, router and this rank's experts."""
    moe, d, f = m.moe, s.d, ffn_hidden(m)
    assert moe is not None, "an MoE block's model has experts"
    n_local = moe.experts // s.ep
    ln_2 = rms_norm(s)
    rows, router = moe_routing(m, s)
    hidden = rows * s.act * f  # per routed row: gate's, up's, silu's outputs and the product, each
    # per row: the row into its expert (bf16 copies for gate and up under autocast), its output and the
    # gate-weighted output (fp32), the row's gate weight and indices
    per_row = (2 * BF16 * d if s.bf16 else FP32 * d) + 2 * FP32 * d + FP32 + 3 * INDEX + (INDEX if s.ep > 1 else 0)
    weights = BF16 * (d * moe.experts + n_local * 3 * d * f) if s.bf16 else 0
    full = attention(m, s) + ln_2 + router + rows * per_row + 4 * hidden + weights
    down_weights = BF16 * n_local * d * f if s.bf16 else 0
    saving = 2 * hidden + down_weights + s.tokens * FP32 * s.heads
    region = math.ceil(2 * hidden / max(n_local, 1)) + (BF16 * d * f if s.bf16 else 0)  # one expert's product
    return full, saving, region


def head_activations(m: ModelConfig, s: Shapes) -> int:
    """ln_f, the output head and the loss of one micro-batch."""
    ln_f = rms_norm(s)
    return ln_f + head_and_loss(m, s)
