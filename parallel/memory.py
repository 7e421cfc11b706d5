"""The memory plan: each rank's bytes for parameters, gradients, optimizer state and activations.

`estimate(layout, config)` returns one `RankMemory` per rank, computed from the model's shapes, a layout
(`parallel.layout`: degrees, stages, schedule) and the job's config before anything runs: no Plan is needed,
so a planner can ask what a candidate layout costs. `parallel.admission.memory_violations` refuses a job
whose ranks cannot fit, and `parallel.present.describe_memory` shows it. Pure arithmetic: no torch.

The counting functions below take `plan`: anything that reads like a layout with a `config` (a
`parallel.sizing.Sizing`, or a `parallel.plan.Plan`, which is one layout and its config). How the
gradients and the optimizer state are split over a reducing group is the sharding strategy's
(`parallel.sharding`, by `parallel.zero`), and the optimizer's bytes per parameter are the optimizer
registry's (`parallel.optimizers`).

Model state (exact, counted from the shapes as `parallel.model` builds them and `parallel.tensor_parallel`
shards them): parameters are fp32 (4 B) whatever the precision; gradients live in fp32 flat buckets that
hold every local parameter (4 B each, also under ZeRO-1, which keeps whole gradients and adds the reduced
1/N slice; see `parallel.data_parallel`); AdamW keeps two fp32 states per parameter (8 B), and with
`parallel.zero: 1` each rank keeps the states of 1/N of the parameters, N the size of the group that reduces
them: dense parameters over dp, the MoE router over the stage's dp x tp ranks, experts over the ranks holding
the same experts (dp / ep x tp).

Activations are what autograd keeps for backward (the pipeline's `_SavedTensorMeter` measures the same
thing, each storage once, parameters excluded). Per micro-batch and chunk the bytes follow from the
tensors each op saves, read off the meter on CPU (torch 2.13) and written out term by term below; the
rank's peak walks its action list (`plan.schedule`) adding a chunk's bytes at its forward and removing them
at its backward, which with unit weights is the simulator's `peak_activations`. Activation checkpointing
keeps less but recomputes one region at a time in backward: that transient (`recompute`, which the meter
does not see, checkpoint's recomputation saves its tensors through its own hooks) is added to the total.

Not counted: the process's own memory (CUDA context, allocator caches and fragmentation, the data batches,
the one bucket ZeRO-1 gathers at a time after the step), transients of the forward and backward kernels,
and the attention matrix of scaled_dot_product_attention's math path, taken where no fused kernel applies
(the flash and memory-efficient paths, which CPU and CUDA take here, keep only a log-sum-exp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallel.config import JobConfig
from parallel.layout import Layout
from parallel.optimizers import optimizer_kind
from parallel.schedules import ActionKind, virtual_stage
from parallel.sharding import sharding_for
from parallel.sizing import Sizing

FP32 = 4
BF16 = 2
INDEX = 8  # int64: token ids, positions, the indices index and topk ops keep
LN_STATS = 2 * FP32  # LayerNorm keeps a mean and a reciprocal std per token


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak."""

    params: int
    grads: int
    optimizer: int
    activations: int
    """Most bytes saved for backward at once over the step (what `peak_activation_bytes` measures)."""
    recompute: int
    """Activation checkpointing: the activations of the region recomputed in backward, held transiently."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.recompute

    def to_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "recompute": self.recompute, "total": self.total}


@dataclass(frozen=True)
class ParamCounts:
    """Local parameter elements of a rank, by the group that reduces their gradients."""

    dense: int
    router: int
    experts: int

    @property
    def total(self) -> int:
        return self.dense + self.router + self.experts


Plan = Sizing
"""The name the counting functions below annotate `plan` with (a `parallel.plan.Plan` reads the same)."""


def estimate(layout: Layout, config: JobConfig) -> list[RankMemory]:
    """Every rank's memory, index = rank. The ranks of one pipeline stage are alike (tp shards are equal and
    every ep rank hosts experts / ep experts), so each stage is computed once: any spec is answered at once."""
    plan = Sizing(layout, config)
    stages = [rank_memory(plan, plan.rank_of(pp, 0, 0)) for pp in range(plan.pp)]
    return [stages[c.pp] for c in plan.ranks]


def rank_memory(plan: Plan, rank: int) -> RankMemory:
    counts = param_counts(plan, plan.coords(rank).pp)
    chunks = [_chunk_activations(plan, pp_rank=plan.coords(rank).pp, chunk=c) for c in range(plan.vpp)]
    return RankMemory(
        params=FP32 * counts.total,
        grads=gradient_bytes(plan, counts),
        optimizer=optimizer_bytes(plan, counts),
        activations=peak_activation_bytes(plan, plan.coords(rank).pp, [kept for kept, _ in chunks]),
        recompute=max(transient for _, transient in chunks),
    )


def param_counts(plan: Plan, pp_rank: int) -> ParamCounts:
    """Exact local parameter counts of a rank's chunks (tied embeddings counted once)."""
    m, tp = plan.config.model, plan.tp
    d, vocab = m.d_model, m.vocab_size
    local_experts = m.moe.experts // plan.ep if m.moe else 0
    dense = router = experts = 0
    for c, layers in enumerate(plan.chunk_layers(pp_rank)):
        v = virtual_stage(pp_rank, c, plan.pp)
        first, last = v == 0, v == plan.n_virtual_stages - 1
        if first:
            dense += vocab * d // tp + m.context * d  # wte split over the vocabulary, wpe replicated
        for block in layers:
            # two LayerNorms (4d); q, k, v column-parallel (weight and bias / tp); attn.proj row-parallel (bias
            # replicated)
            dense += 4 * d + 3 * (d * d + d) // tp + d * d // tp + d
            if m.is_moe_block(block):
                router += d * m.moe.experts  # no bias, not sharded
                experts += local_experts * (4 * d * d + 4 * d + 4 * d * d + d)  # whole experts on every tp rank
            else:
                dense += (4 * d * d + 4 * d) // tp + 4 * d * d // tp + d  # fc column-, proj row-parallel
        if last:
            dense += 2 * d + (0 if m.tie_embeddings and first else vocab * d // tp)
    return ParamCounts(dense=dense, router=router, experts=experts)


def _reduced_sets(plan: Plan, counts: ParamCounts) -> list[tuple[int, int]]:
    """(local parameters, ranks that reduce their gradients) of each set: dense parameters over dp, the router
    over the stage's dp x tp ranks, experts over the dp / ep x tp ranks holding the same experts."""
    return [(counts.dense, plan.dp), (counts.router, plan.dp * plan.tp),
            (counts.experts, plan.dp // plan.ep * plan.tp)]


def gradient_bytes(plan: Plan, counts: ParamCounts) -> int:
    """fp32 buckets holding every local gradient; with ZeRO-1 also the reduced 1/N slice of them; with
    `reduce_dtype: bf16` the bf16 copies on the wire (every bucket's at once at worst, as the reduction
    overlaps backward). A set reduced by no other rank (N = 1) is neither sharded nor sent."""
    par, bytes_ = plan.config.parallel, 0
    sharding = sharding_for(par.zero)
    for n, size in _reduced_sets(plan, counts):
        held = sharding.gradient_elements(n, size)
        bytes_ += FP32 * held + (BF16 * held if par.reduce_dtype == "bf16" and size > 1 else 0)
    return bytes_


def optimizer_bytes(plan: Plan, counts: ParamCounts) -> int:
    """The optimizer's state (AdamW: exp_avg and exp_avg_sq, fp32) for the parameter elements whose state the
    sharding strategy keeps on this rank (ZeRO-1: 1/N of each set, N its reducing group)."""
    sharding = sharding_for(plan.config.parallel.zero)
    elements = sum(sharding.optimizer_elements(n, size) for n, size in _reduced_sets(plan, counts))
    return optimizer_kind(plan.config.optimizer).state_bytes(elements)


def peak_activation_bytes(plan: Plan, pp_rank: int, chunk_bytes: list[int]) -> int:
    """Walk the rank's actions: a forward adds its chunk's bytes, the backward frees them."""
    live = peak = 0
    for action in plan.schedule[pp_rank]:
        if action.kind is ActionKind.FORWARD:
            live += chunk_bytes[action.chunk]
            peak = max(peak, live)
        elif action.kind is ActionKind.BACKWARD:
            live -= chunk_bytes[action.chunk]
    return peak


@dataclass(frozen=True)
class _Shapes:
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

    @property
    def act(self) -> int:
        """Bytes of an element a matmul keeps: its bf16 copy under autocast, else fp32."""
        return BF16 if self.bf16 else FP32


def _shapes(plan: Plan) -> _Shapes:
    m, par = plan.config.model, plan.config.parallel
    tokens = plan.micro_batch_size * m.seq_len
    return _Shapes(d=m.d_model, heads=m.n_head // plan.tp, tokens=tokens,
                   stream=tokens // plan.tp if par.sp else tokens, tp=plan.tp,
                   bf16=plan.config.precision == "bf16")


def _chunk_activations(plan: Plan, pp_rank: int, chunk: int) -> tuple[int, int]:
    """(bytes kept for backward by one micro-batch through this chunk, transient bytes of recomputation)."""
    m, mode = plan.config.model, plan.config.activation_checkpointing
    s = _shapes(plan)
    v = virtual_stage(pp_rank, chunk, plan.pp)
    kept = transient = 0
    if v == 0:
        kept += INDEX * s.tokens + INDEX * m.seq_len  # wte keeps the token ids, wpe the positions
    for block in plan.stage_layers[v]:
        if m.is_moe_block(block):
            full, selective_saving, region = _moe_block(plan, s)
        else:
            full, selective_saving, region = _dense_block(s)
        if mode == "full":
            kept += FP32 * s.d * s.stream  # only the block's input: checkpoint keeps it to recompute the block
            transient = max(transient, full)
        elif mode == "selective":
            kept += full - selective_saving
            transient = max(transient, region)
        else:
            kept += full
    if v == plan.n_virtual_stages - 1:
        kept += _head(plan, s)
    return kept, transient


def _attention(s: _Shapes) -> int:
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


def _dense_block(s: _Shapes) -> tuple[int, int, int]:
    """(bytes kept with no checkpointing, bytes selective checkpointing saves, its recomputed region's bytes)."""
    d = s.d
    ln_2 = s.stream * (FP32 * d + LN_STATS)
    mlp_input = s.tokens * s.act * d  # ln_2's output (its bf16 copy under autocast), kept by fc
    hidden = s.tokens * s.act * 4 * d // s.tp  # fc's output (kept by GELU) and GELU's (kept by proj) each
    weights = BF16 * 8 * d * d // s.tp if s.bf16 else 0
    full = _attention(s) + ln_2 + mlp_input + 2 * hidden + weights
    # selective: GELU with proj is recomputed (GELU's output and, under autocast, proj's bf16 weight are not
    # kept), and so is the attention core (its log-sum-exp; q, k, v and the output are kept anyway)
    proj_weight = BF16 * 4 * d * d // s.tp if s.bf16 else 0
    saving = hidden + proj_weight + s.tokens * FP32 * s.heads
    return full, saving, hidden + proj_weight


def _moe_block(plan: Plan, s: _Shapes) -> tuple[int, int, int]:
    """As `_dense_block`, for a mixture-of-experts block: attention, ln_2, router and this rank's experts."""
    m = plan.config.model
    moe, d = m.moe, s.d
    n_local = moe.experts // plan.ep
    routed = s.tokens // s.tp  # each tp rank routes its slice of every sequence
    rows = math.ceil(routed * moe.top_k * _kept_fraction(plan))  # (token, expert) pairs, balanced over ep
    ln_2 = s.stream * (FP32 * d + LN_STATS)
    # Per routed token: the router's input (ln_2's output slice, or its bf16 copy), its fp32 logits (kept by
    # the z-loss) and probabilities, the top-k values and indices, and the gate sums and log-sum-exp.
    router = routed * (s.act * d + 2 * FP32 * moe.experts + moe.top_k * (INDEX + FP32) + 2 * FP32)
    # Per routed row: the row going into its expert (a bf16 copy under autocast), the expert's hidden before
    # and after GELU (4d each), its output and the gate-weighted output (fp32), and the row's gate weight and
    # indices (which rows were kept, their order, their token; with ep also their order on arrival).
    hidden = rows * s.act * 4 * d
    per_row = s.act * d + 2 * FP32 * d + FP32 + 3 * INDEX + (INDEX if plan.ep > 1 else 0)
    weights = BF16 * (d * moe.experts + n_local * 8 * d * d) if s.bf16 else 0
    full = _attention(s) + ln_2 + router + rows * per_row + 2 * hidden + weights
    proj_weights = BF16 * n_local * 4 * d * d if s.bf16 else 0
    saving = hidden + proj_weights + s.tokens * FP32 * s.heads
    region = math.ceil(hidden / max(n_local, 1)) + (BF16 * 4 * d * d if s.bf16 else 0)  # one expert's GELU
    return full, saving, region


def _kept_fraction(plan: Plan) -> float:
    """Fraction of (token, expert) choices the experts keep: 1 dropless, at most capacity x experts of a
    sequence's seq_len x top_k choices with a capacity factor."""
    m = plan.config.model
    if m.moe.capacity_factor is None:
        return 1.0
    cap = math.ceil(m.moe.capacity_factor * m.seq_len * m.moe.top_k / m.moe.experts)
    return min(1.0, cap * m.moe.experts / (m.seq_len * m.moe.top_k))


def _head(plan: Plan, s: _Shapes) -> int:
    """ln_f, the output head and the loss of one micro-batch."""
    m = plan.config.model
    d, vocab = s.d, m.vocab_size
    ln_f = s.stream * (FP32 * d + LN_STATS)
    head_input = s.tokens * s.act * d  # ln_f's output (all-gathered under sp), kept by lm_head
    weight = BF16 * vocab * d // s.tp if s.bf16 else 0
    # cross_entropy keeps its fp32 log-softmax, vocab / tp wide (loss_parallel), and the targets
    loss = s.tokens * (FP32 * vocab // s.tp + INDEX) + FP32
    return ln_f + head_input + weight + loss
