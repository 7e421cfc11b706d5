"""The memory plan: each rank's bytes for parameters, gradients, optimizer state and activations.

`estimate(layout, config)` returns one `RankMemory` per rank, computed from the model's shapes, a layout
(`parallel.plan.layout`: degrees, stages, schedule) and the job's config before anything runs: no Plan is needed,
so a planner can ask what a candidate layout costs. `parallel.plan.admission.memory_violations` refuses a job
whose ranks cannot fit, and `parallel.plan.present.describe_memory` shows it. Pure arithmetic: no torch.

The counting functions below take `plan`: anything that reads like a layout with a `config` (a
`parallel.plan.sizing.Sizing`, or a `parallel.plan.Plan`, which is one layout and its config). How the
gradients and the optimizer state are split over a reducing group is the sharding strategy's
(`parallel.plan.sharding`, by `parallel.zero`), and the optimizer's bytes per parameter are the optimizer
registry's (`parallel.optim.kinds`).

Model state (exact, counted by the model's family, `ModelFamily.param_counts`, from the shapes its stages
have and its tensor-parallel plan shards): parameters are fp32 (4 B) whatever the precision (with
`parallel.zero: 2 | 3` a 1/N shard plus what FSDP2 holds gathered at the peak: at ZeRO-2 every chunk, at ZeRO-3
two units (blocks, or a block and the embedding or the head): `param_bytes`, `parallel.plan.memory.fsdp`);
gradients live in fp32 flat buckets that hold every local parameter (4 B each, also under ZeRO-1, which keeps whole
gradients and adds the reduced 1/N slice; see `parallel.runtime.dp.data_parallel`); AdamW keeps two fp32 states per
parameter (8 B), and with `parallel.zero: 1` each rank keeps the states of 1/N of the parameters, N the size
of the group that reduces them: dense parameters over dp, the MoE router over the stage's dp x tp ranks,
experts over the ranks holding the same experts (dp / ep x tp).

With `model.lora` the base is frozen: its weights count as parameters only, and the gradients and the optimizer
state are the adapters' (`trainable_counts`; `ModelFamily.adapter_elements` counts them, split over tp as the
base is).

Start-up (`startup`): the rank builds its chunks on the meta device and materializes only its shards, drawing one
whole parameter at a time (`construction`, the largest of its chunks) before keeping its slice: its parameter
shards plus that one parameter.

ZeRO-2/3's `reduction`: the step peaks in the backward of the rank's largest unit (the head or the embedding at a
real vocabulary), holding one whole gradient of it besides the above: the loss's returned head gradient next to
the one kept from forward, or the embedding's next to its gathered weight (on gloo the collectives copy nothing,
`parallel.runtime.dp.gloo_comms`). Measured (`scale` bench, 501M Llama, zero=3, BENCHMARKS.md): the plan 6-7% above the
peak at dp=4, 9% at dp=8, where it also counts every gradient shard beside the head's backward, before any exists
(each is made by its unit's reduce-scatter). Not counted: the optimizer step's temporaries (AdamW's
foreach), bounded to STEP_CHUNK elements (64 MiB, `parallel.runtime.train_optimizer`) after the backward.

Gradient compression adds what the compressor keeps (PowerSGD: its error-feedback and factor buffers) to the gradients
(`parallel.plan.reduction_bytes.compression_state_bytes`).

Activations are what autograd keeps for backward (the pipeline's `_SavedTensorMeter` measures the same
thing, each storage once, parameters excluded). Per micro-batch and chunk the bytes follow from the
tensors each op saves, read off the meter on CPU (torch 2.13) and written out term by term by the model's
family (`parallel.models.<family>.counts`: embedding, each block, the head); the
rank's peak walks its action list (`plan.actions`) adding a chunk's bytes at its forward and removing them
at its backward, which with unit weights is the simulator's `peak_activations`. Activation checkpointing
keeps less but recomputes one region at a time in backward: that transient (`recompute`, which the meter
does not see, checkpoint's recomputation saves its tensors through its own hooks) is added to the total. So is,
on the rank holding the head, the fused loss's transient (`loss`: one chunk's fp32 logits and log-softmax, and
the copies it works on, at the end of a micro-batch's forward), the larger of the two, as they never coincide:
with it the total is a rank's whole peak on the CPU to 1% (tests/integration/test_memory_peak.py counts every
storage from construction through three steps).

Not counted: the process's own memory (CUDA context, allocator caches and fragmentation, the data batches,
the one bucket ZeRO-1 gathers at a time after the step), transients of the forward and backward kernels,
and the attention matrix of scaled_dot_product_attention's math path, taken where no fused kernel applies
(the flash and memory-efficient paths, which CPU and CUDA take here, keep only a log-sum-exp).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.parallel.config import JobConfig
from trainyard.parallel.models.counting import BF16, FP32, ParamCounts, Shapes, by_block_kind, fused_loss_transient
from trainyard.parallel.plan.layout import Layout
from trainyard.parallel.plan.memory.fsdp import gathered_bytes, largest_unit_grad_bytes
from trainyard.parallel.plan.reduction_bytes import compression_state_bytes
from trainyard.parallel.plan.reduction_sets import reduced_sets
from trainyard.parallel.plan.schedule.actions import FREEING_KINDS, ActionKind, virtual_stage
from trainyard.parallel.plan.sizing import Sizing


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
    loss: int = 0
    """The rank holding the head: the fused loss's transient at the end of a micro-batch's forward
    (`parallel.models.counting.fused_loss_transient`). Never at once with `recompute`'s (in backward): the step's
    peak adds the larger of the two (`transient`)."""
    host_optimizer: int = 0
    """`optimizer.offload`: the optimizer's state in host memory, with host copies of what it updates and of
    their gradients (`optimizer` is then 0; `host_copy_bytes`: pinned on a GPU rank)."""
    host_activations: int = 0
    """`activation_offload`: most bytes of the blocks' saved activations in host memory at once."""
    gathered: int = 0
    """Of `params`, with ZeRO-2/3: the bytes FSDP2 holds gathered whole at the step's peak (`gathered_bytes`;
    ZeRO-3: per block), what the runtime's `peak_gathered_bytes` measures."""
    reduction: int = 0
    """ZeRO-2/3: one whole gradient of the rank's largest unit, the transient of its backward and reduce-scatter
    (`largest_unit_grad_bytes`)."""
    construction: int = 0
    """Construction's transient, in host memory: one whole parameter (the largest of the rank's chunks), drawn
    from its (seed, name) generator before the rank keeps its slice (`parallel.runtime.materialize`)."""

    @property
    def startup(self) -> int:
        """Bytes at the start-up peak: the rank's parameter shards (nothing gathered yet) and construction's one
        whole parameter; on a GPU rank the shards are on the device and the whole parameter on the host."""
        return self.params - self.gathered + self.construction

    @property
    def transient(self) -> int:
        """The larger of the recomputation's transient (backward) and the loss's (forward)."""
        return max(self.recompute, self.loss)

    @property
    def total(self) -> int:
        """Device bytes."""
        return self.params + self.grads + self.optimizer + self.activations + self.transient + self.reduction

    @property
    def host(self) -> int:
        return self.host_optimizer + self.host_activations

    @property
    def host_resident(self) -> int:
        """A GPU rank's peak in host memory: offload's host bytes, or construction's one whole parameter (first)."""
        return max(self.host, self.construction)

    def resident(self, on_gpu: bool) -> int:
        """Bytes in the memory a rank is sized against: a GPU rank's device bytes; a CPU rank's device is the
        host, so what offload moves "to the host" stays in the same memory, and so does construction's transient
        (the step's peak, or the start-up peak where that is larger)."""
        return self.total if on_gpu else max(self.total + self.host, self.startup)

    def to_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "recompute": self.recompute, "loss": self.loss,
                "total": self.total,
                "host_optimizer": self.host_optimizer, "host_activations": self.host_activations,
                "host_total": self.host, "gathered": self.gathered, "reduction": self.reduction,
                "construction": self.construction,
                "startup": self.startup}


Plan = Sizing
"""The name the counting functions below annotate `plan` with (a `parallel.plan.Plan` reads the same)."""


def estimate(layout: Layout, config: JobConfig) -> list[RankMemory]:
    """Every rank's memory, index = rank. The ranks of one pipeline stage are alike (tp shards are equal and
    every ep rank hosts experts / ep experts), so each stage is computed once: any spec is answered at once."""
    plan = Sizing(config, layout=layout)
    stages = [rank_memory(plan, plan.rank_of(pp, 0, 0)) for pp in range(plan.pp)]
    return [stages[c.pp] for c in plan.ranks]


def rank_memory(plan: Plan, rank: int) -> RankMemory:
    counts = trainable_counts(plan, plan.coords(rank).pp)
    pp = plan.coords(rank).pp
    chunks = [_chunk_activations(plan, pp_rank=pp, chunk=c) for c in range(plan.vpp)]
    offloaded = [_offloaded_activations(plan, pp, c) for c in range(plan.vpp)]
    state = optimizer_bytes(plan, counts)
    offload = plan.config.optimizer.offload
    return RankMemory(
        params=param_bytes(plan, pp),
        grads=gradient_bytes(plan, counts) + compression_state_bytes(plan, pp),
        optimizer=0 if offload else state,
        activations=peak_activation_bytes(plan, pp, [kept - host for (kept, _), host in zip(chunks, offloaded,
                                                                                              strict=True)]),
        recompute=max(transient for _, transient in chunks),
        loss=fused_loss_transient(plan.config.model, _shapes(plan)) if _holds_head(plan, pp) else 0,
        host_optimizer=state + host_copy_bytes(plan, pp, counts) if offload else 0,
        host_activations=peak_activation_bytes(plan, pp, offloaded),
        gathered=gathered_bytes(plan, pp),
        reduction=largest_unit_grad_bytes(plan, pp),
        construction=construction_bytes(plan, pp),
    )


def pinned_bytes(n: int) -> int:
    """What torch's pinned-memory allocator takes for a block of n bytes: the next power of two (its
    CachingHostAllocator rounds every block up, to reuse them)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def host_copy_bytes(plan: Plan, pp_rank: int, counts: ParamCounts) -> int:
    """`optimizer.offload`: the host copy and host gradient of every tensor the optimizer updates
    (`parallel.runtime.train_optimizer`), fp32. On a GPU rank they are pinned, each rounded up to a power of two
    (`pinned_bytes`: a 4096 x 11008 matrix's 172 MiB take 256), counted per matrix of the rank's chunks at its
    local shape, times the share of its elements this rank updates (ZeRO: about 1/N); the 1-D parameters and the
    LoRA adapters unrounded (small)."""
    elements = optimizer_elements(plan, counts)
    if not plan.gpus_per_worker or plan.config.model.lora is not None:
        return 2 * FP32 * elements
    m, family = plan.config.model, plan.family
    share = elements / max(1, counts.total)
    leaves = []
    for c, layers in enumerate(plan.chunk_layers(pp_rank)):
        v = virtual_stage(pp_rank, c, plan.pp, plan.placement)
        matrices = family.matrices(m, layers, first=v == 0, last=v == plan.n_virtual_stages - 1, tp=plan.tp,
                                   ep=plan.ep)
        leaves += [round(rows * cols * share) for rows, cols, _ in matrices]
    rest = max(0, elements - sum(leaves))
    return 2 * (sum(pinned_bytes(FP32 * n) for n in leaves) + FP32 * rest)


def _holds_head(plan: Plan, pp_rank: int) -> bool:
    last = plan.n_virtual_stages - 1
    return any(virtual_stage(pp_rank, c, plan.pp, plan.placement) == last for c in range(plan.vpp))


def construction_bytes(plan: Plan, pp_rank: int) -> int:
    """fp32 bytes of the largest whole parameter of the rank's chunks: what construction holds besides the shards
    while it draws one parameter whole and keeps this rank's slice (with `init_from`, the block it reads: a
    bound). The matrices at tp = 1 are the whole ones; 1-D parameters (norms, biases) are smaller than any."""
    m, family = plan.config.model, plan.family
    largest = 0
    for c, layers in enumerate(plan.chunk_layers(pp_rank)):
        v = virtual_stage(pp_rank, c, plan.pp, plan.placement)
        kinds = tuple({m.is_moe_block(i): i for i in layers}.values())  # one block of each kind has every shape
        matrices = family.matrices(m, kinds, first=v == 0, last=v == plan.n_virtual_stages - 1, tp=1, ep=plan.ep)
        largest = max([largest, *(rows * cols for rows, cols, _ in matrices)])
    return FP32 * largest


def param_counts(plan: Plan, pp_rank: int) -> ParamCounts:
    """Exact local parameter counts of a rank's chunks (tied embeddings counted once), by the model's family."""
    total = ParamCounts(dense=0, router=0, experts=0)
    for counts in _chunk_counts(plan, pp_rank):
        total += counts
    return total


def trainable_counts(plan: Plan, pp_rank: int) -> ParamCounts:
    """The local parameters that get gradients and optimizer state: with `model.lora` its adapters alone (dense,
    reduced over dp), the frozen base being parameters only; else all of them."""
    m = plan.config.model
    if m.lora is None:
        return param_counts(plan, pp_rank)
    adapters = sum(plan.family.adapter_elements(m, layers, tp=plan.tp) for layers in plan.chunk_layers(pp_rank))
    return ParamCounts(dense=adapters, router=0, experts=0)


def _chunk_counts(plan: Plan, pp_rank: int) -> list[ParamCounts]:
    """Each chunk's local parameters, LoRA's adapters (dense) included."""
    m, family = plan.config.model, plan.family
    out = []
    for c, layers in enumerate(plan.chunk_layers(pp_rank)):
        v = virtual_stage(pp_rank, c, plan.pp, plan.placement)
        counts = family.param_counts(m, layers, first=v == 0, last=v == plan.n_virtual_stages - 1, tp=plan.tp,
                                     ep=plan.ep)
        out.append(counts + ParamCounts(dense=family.adapter_elements(m, layers, tp=plan.tp), router=0, experts=0))
    return out


def param_bytes(plan: Plan, pp_rank: int) -> int:
    """fp32 parameters: every local one, or with ZeRO-2/3 the 1/N shard of each set reduced over N > 1 ranks
    plus what is gathered whole at the step's peak (`gathered_bytes`)."""
    sharding = plan.sharding
    total = sum(_chunk_counts(plan, pp_rank), ParamCounts(dense=0, router=0, experts=0))
    kept = sum(sharding.param_elements(n, size) for n, size in reduced_sets(plan.layout, total))
    return FP32 * kept + gathered_bytes(plan, pp_rank)


def gradient_bytes(plan: Plan, counts: ParamCounts) -> int:
    """fp32 buckets holding every local gradient; with ZeRO-1 also the reduced 1/N slice of them; with
    `reduce_dtype: bf16` the bf16 copies on the wire (every bucket's at once at worst, as the reduction
    overlaps backward). ZeRO-2/3 keep the reduced 1/N shard only (the whole gradient of the block whose
    backward is running lives until its reduce-scatter: a transient, not counted). A set reduced by no
    other rank (N = 1) is neither sharded nor sent."""
    par, sharding, bytes_ = plan.parallel, plan.sharding, 0
    for n, size in reduced_sets(plan.layout, counts):
        held = sharding.gradient_elements(n, size)
        wire = par.reduce_dtype == "bf16" and size > 1 and not sharding.shards_parameters  # FSDP2's is transient
        bytes_ += FP32 * held + (BF16 * held if wire else 0)
    return bytes_


def optimizer_elements(plan: Plan, counts: ParamCounts) -> int:
    """The parameter elements whose optimizer state the sharding strategy keeps on this rank (ZeRO-1: 1/N of
    each set, N its reducing group)."""
    sharding = plan.sharding
    return sum(sharding.optimizer_elements(n, size) for n, size in reduced_sets(plan.layout, counts))


def optimizer_bytes(plan: Plan, counts: ParamCounts) -> int:
    """The optimizer's state for this rank's elements, by the registry (`parallel.optim.kinds`: AdamW 8 B per
    element, adamw8bit about 2, adamw4bit about 1, adafactor about 8 / d_model, sgd 4): on the device, or with
    `optimizer.offload` on the host."""
    return plan.optimizer.state_bytes(optimizer_elements(plan, counts), plan.config.model.d_model)


def _offloaded_activations(plan: Plan, pp_rank: int, chunk: int) -> int:
    """`activation_offload`: the bytes of one micro-batch's chunk that the blocks save (those go to the host;
    the embedding's and the head's stay on the device)."""
    if not plan.config.activation_offload:
        return 0
    kept, _ = _chunk_activations(plan, pp_rank, chunk)
    m, family, s = plan.config.model, plan.family, _shapes(plan)
    v = virtual_stage(pp_rank, chunk, plan.pp)
    stays = (family.embed_activations(m, s) if v == 0 else 0) + \
        (family.head_activations(m, s) if v == plan.n_virtual_stages - 1 else 0)
    return kept - stays


def peak_activation_bytes(plan: Plan, pp_rank: int, chunk_bytes: list[int]) -> int:
    """Walk the rank's actions: a forward adds its chunk's bytes, the backward (or its weight half) frees them."""
    live = peak = 0
    for action in plan.actions[pp_rank]:
        if action.kind is ActionKind.FORWARD:
            live += chunk_bytes[action.chunk]
            peak = max(peak, live)
        elif action.kind in FREEING_KINDS:
            live -= chunk_bytes[action.chunk]
    return peak


def _shapes(plan: Plan) -> Shapes:
    """One micro-batch as this rank holds it: with context parallelism 1/cp of every sequence (its two chunks), the
    ring keeping only its own tokens' q, k, v, output and log-sum-exp for backward (`parallel.runtime.cp.ring`)."""
    m, par = plan.config.model, plan.parallel
    seq = m.seq_len // plan.layout.cp
    tokens = plan.micro_batch_size * seq
    return Shapes(d=m.d_model, heads=m.n_head // plan.tp, tokens=tokens,
                  stream=tokens // plan.tp if par.sp else tokens, tp=plan.tp,
                  bf16=plan.config.precision == "bf16", seq_len=seq, ep=plan.ep)


def _chunk_activations(plan: Plan, pp_rank: int, chunk: int) -> tuple[int, int]:
    """(bytes kept for backward by one micro-batch through this chunk, transient bytes of recomputation)."""
    m, mode = plan.config.model, plan.config.activation_checkpointing
    family, s = plan.family, _shapes(plan)
    v = virtual_stage(pp_rank, chunk, plan.pp, plan.placement)
    kept = transient = 0
    if v == 0:
        kept += family.embed_activations(m, s)
    activations = by_block_kind(m, lambda block: family.block_activations(m, block, s))
    for block in plan.stage_layers[v]:
        full, selective_saving, region = activations(block)
        if mode == "full":
            kept += FP32 * s.d * s.stream  # only the block's input: checkpoint keeps it to recompute the block
            transient = max(transient, full)
        elif mode == "selective":
            kept += full - selective_saving
            transient = max(transient, region)
        else:
            kept += full
    if v == plan.n_virtual_stages - 1:
        kept += family.head_activations(m, s)
    return kept, transient
