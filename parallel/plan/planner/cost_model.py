"""The cost model: a laid-out job's step time from measured machine costs, term by term.

`MachineCosts` (`parallel.plan.planner.machine_costs`) holds what a calibration run measured on one node type: the rate
the trainer runs a model's FLOPs at, by width (and a matmul's, as latency + FLOPs / throughput), the all-reduce,
point-to-point, all-to-all, all-gather and reduce-scatter times as latency + bytes / bandwidth (alpha-beta), the
optimizer's time per parameter element, the trainer's fixed costs (per block and per chunk of each micro-batch, per
step, the extra per block of tensor parallelism's DTensors and of sequence parallelism, and of each ZeRO level's
FSDP2 machinery), and how much slower compute runs when k ranks share one node (`contention`: ranks sharing CPU
cores; 1 where each rank has its own device). `step_costs(layout, config, machine)` turns a layout into the
per-chunk forward / backward / point-to-point costs the schedule simulator takes plus the terms outside the
pipeline (the data-parallel reduction not hidden behind backward, the optimizer step, the options' own extras);
`parallel.plan.planner.planner` simulates the schedule with them and adds the rest.

What is written by hand and why: the FLOPs of a chunk come from the family's `flops_per_token` (6 N + 12 L d T),
shared out over the blocks; the collectives' message sizes are Megatron's (two activation all-reduces per block
forward and two in backward under tp; two all-to-alls per MoE block each way under ep; one activation per
micro-batch between pipeline stages; every local gradient once per step over dp, or as the `parallel.plan.sharding`
strategy says: reduce-scattered once or every micro-batch, the parameters all-gathered after the step, once per
chunk or around every forward and backward, in `sharding_costs`, over the replica's dp x cp ranks). Under context
parallelism a rank computes 1/cp of each sequence's tokens, its attention too (the head-tail chunks balance the
causal work), and its ring passes each block's keys and values round the cp group in forward and backward
(`ring_costs`: what the block's attention does not hide, and the dK/dV shifts, which nothing hides). Options that
change the time in their own way are one line each in `OPTION_EXTRAS` (an offload adds its entry there). The fixed
costs and the contention are measured, not written here (before a node type is calibrated,
`machine_costs.default_gpu_costs` stands in). On a node whose ranks share CPU cores (a measured `contention`), a
collective is CPU work on those same cores: it is slowed as compute is, by the node's slowdown over the one it was
measured at (`comm_share`), and the data-parallel reduction hides behind nothing, since no core is idle to run it
during the backward (on this 2-core machine 4 ranks measured well above their prediction before this term); a
pipeline's stages are not all busy at once, so its simulation speeds a compute up by how many compute beside it
(`pipeline_sharing`; a stage waiting in the bubble lends the others its core). A tensor-parallel shard's FLOPs run
at the rate of a model as wide as the shard (narrower matrices, and the norms and residuals stay whole on every
shard). Ignored: kernel fusion and overlap inside a chunk, stragglers, contention between groups sharing a link, the
first step's warm-up. Pure arithmetic: no torch.

At scale (a device profile's or a GPU calibration's costs, `parallel.plan.planner.device_profile`), what published
large runs depend on, and where it is here: compute at the fraction of peak a matmul of the shard's width reaches,
attention at its flash kernel's rate, compile's fused kernels (`MachineCosts.compile_speedup`); tp all-reduces
inside a node (a tp group is one node's bundle); pp hand-overs across nodes on the GPU's own NIC (`pipeline_p2p`);
the dp reduction (all-reduce, or ZeRO's reduce-scatters) and ZeRO-3's prefetched gathers overlapped with the step's
compute, only what is left over exposed (plain dp: behind the backward only); hierarchical collectives (a group
spanning nodes runs at the smaller of the node's bus bandwidth and its ranks' NICs on each node,
`MachineCosts.collective`); MoE all-to-alls (inside or across nodes alike); selective and full recompute
(RECOMPUTE_EXTRA); sequence parallelism's smaller hand-overs; the bubble of every schedule kind, interleaved ones
included, from the simulator; context parallelism's ring (`ring_costs`), inside a node or on the NICs. Left out: the
ring's fp32 blocks running slower than the flash kernel (charged at its rate, as at cp = 1) and its per-block
launches, tp collectives overlapped with compute (Megatron's with the weight-gradient GEMMs, async
TP), contention at the top-of-rack switches, power and clock limits (a profile's peak is what it says), fp8 matmuls."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from trainyard.parallel.config import JobConfig, ModelConfig
from trainyard.parallel.plan.layout import Layout
from trainyard.parallel.plan.memory.estimate import ParamCounts, param_counts
from trainyard.parallel.plan.planner.machine_costs import MachineCosts
from trainyard.parallel.plan.sharding import Sharding
from trainyard.parallel.plan.sizing import Resolved, Sizing

RECOMPUTE_EXTRA = {"none": 0.0, "selective": 0.15, "full": 1.0}
"""Forwards re-run in backward per `activation_checkpointing` mode, as a fraction of the forward (an unknown
mode: a whole forward)."""


@dataclass(frozen=True)
class StepCosts:
    """A layout's costs: the simulator's per-chunk ones and the terms outside the pipeline, in seconds."""

    forward: float
    """One forward of the slowest chunk, tp/ep collectives included."""
    backward: float
    comm: float
    """One point-to-point run between pipeline stages."""
    compute_per_chunk: float
    """forward + backward of one chunk without their collectives (what the bubble is measured against)."""
    tp_per_chunk: float
    """tp all-reduces (or sp gathers) of one chunk's forward and backward."""
    ep_per_chunk: float
    """ep all-to-alls of one chunk's forward and backward."""
    dp_exposed: float
    """The gradient reduction not hidden behind backward."""
    optimizer: float
    """The optimizer step and the step's measured fixed cost (`MachineCosts.step_s`), slowed by contention."""
    extras: dict[str, float]
    """The options' own terms (OPTION_EXTRAS), by name."""
    cp_per_chunk: float = 0.0
    """The ring attention's exchanges of one chunk's forward and backward not hidden behind its blocks (cp > 1)."""
    recompute_per_chunk: float = 0.0
    """The part of compute_per_chunk that re-runs forwards in backward (activation checkpointing)."""
    shared: tuple[float, ...] = ()
    """Where a pipeline's ranks share one node's cores: a chunk's forward or backward time with k of the pp stages
    computing at once (index k - 1) over its time above, with all of them computing (`schedule_timing.Costs.shared`:
    a stage idle in the bubble lends the others its core); (): no such sharing."""


@dataclass(frozen=True)
class ExtraContext:
    """What an option's extra-time hook may read."""

    layout: Layout
    config: JobConfig
    machine: MachineCosts
    params: int
    """Local parameter elements of the largest stage."""
    optimizer_elements: int
    activation_bytes: int
    """Activation bytes of one micro-batch through the slowest chunk."""
    comm_share: float = 1.0
    """The factor on every collective and copy of this layout (`MachineCosts.comm_share`)."""


OPTION_EXTRAS: dict[tuple[str, object], Callable[[ExtraContext], tuple[str, float]]] = {
    # the optimizer steps on the host: the gradients go down and the parameters come back over the host link
    ("optimizer.offload", True): lambda c: ("optimizer offload", 2 * c.comm_share * c.machine.p2p.time(4 * c.params)),
    # each micro-batch's activations go to the host after its forward and come back before its backward
    ("activation_offload", True): lambda c: ("activation offload", 2 * c.layout.microbatches * c.layout.vpp
                                             * c.comm_share * c.machine.p2p.time(c.activation_bytes)),
}
"""(dotted option, value) -> (name, seconds per step) the option adds; one line per option that needs one (the
data-parallel sharding levels' collectives are the strategy's own: `sharding_costs`)."""


def option_value(config: JobConfig, path: str) -> object:
    """The value of a dotted option (`parallel.zero`) in a config; None when the config has no such field."""
    obj: object = config
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def step_costs(layout: Layout, config: JobConfig, machine: MachineCosts, *, node_gpus: int = 0) -> StepCosts:
    """The layout's per-chunk and per-step costs on this machine (`node_gpus`: devices per node, for whether
    a group spans nodes; 0: one node)."""
    resolved = Resolved(config)
    m, par, sharding = config.model, resolved.parallel, resolved.sharding
    tokens = layout.micro_batch_size * m.seq_len // layout.cp  # the rank's: 1/cp of each sequence, head-tail balanced
    act_bytes = 2 if config.precision == "bf16" else 4
    fpt_fwd = _flops_per_token(m) / 3
    head_fwd = 2 * m.vocab_size * m.d_model
    block_fwd = max(fpt_fwd - head_fwd, 0.0) / m.n_layer
    n_stages = layout.n_virtual_stages
    per_stage = [len(layers) for layers in layout.stage_layers] or [m.n_layer // n_stages]
    heaviest = max(range(n_stages), key=lambda v: per_stage[v] * block_fwd + (head_fwd if v == n_stages - 1 else 0))
    blocks = per_stage[heaviest]
    flops = (blocks * block_fwd + (head_fwd if heaviest == n_stages - 1 else 0)) * tokens / layout.tp
    on_node = min(layout.world_size, node_gpus or layout.world_size)  # ranks sharing a node
    slow, share = machine.slowdown(on_node), machine.comm_share(on_node)
    fixed_fwd, fixed_bwd = fixed_costs(machine, blocks, layout.tp, par.sp, layout.pp)
    recompute = RECOMPUTE_EXTRA.get(config.activation_checkpointing, 1.0)
    rate = machine.flops_per_s(m.d_model / layout.tp, tokens)  # a shard's matrices run at a narrower model's rate
    if config.compile:
        rate *= machine.compile_speedup
    seconds = flops / rate  # one forward's FLOPs; attention's own at its kernel's rate where that is known
    attention = blocks * 4 * m.d_model * m.seq_len * tokens / layout.tp  # the rank's queries against every key
    if machine.attention_flops_per_s:
        seconds += attention / machine.attention_flops_per_s - attention / rate
    fwd = slow * (fixed_fwd + seconds)
    bwd = slow * (fixed_bwd + recompute * fixed_fwd + (2 + recompute) * seconds)

    within = node_gpus or layout.world_size
    act = tokens * m.d_model * act_bytes
    tp_one = share * machine.collective("allreduce", act, layout.tp, spans_nodes=layout.tp > within,
                                        per_node=min(layout.tp, within))
    tp_f, tp_b = 2 * blocks * tp_one, (2 + 2 * (recompute >= 1)) * blocks * tp_one
    moe_blocks = sum(m.is_moe_block(b) for b in layout.stage_layers[heaviest]) if layout.stage_layers else 0
    ep_one = 0.0
    if m.moe is not None and layout.ep > 1:
        sent = tokens / layout.tp * m.moe.top_k * m.d_model * act_bytes
        ep_one = share * machine.collective("alltoall", sent, layout.ep, spans_nodes=layout.ep * layout.tp > within,
                                            per_node=max(1, min(layout.ep, within // layout.tp)))
    ep_f, ep_b = 2 * moe_blocks * ep_one, 2 * moe_blocks * ep_one
    message = act / layout.tp if par.sp else act
    comm = pipeline_p2p(machine, message, layout, within) * share if layout.pp > 1 else 0.0
    hides = not (machine.contention and slow > 1.0)  # a transfer hides behind compute unless the cores run both
    ring_f, ring_b = ring_costs(machine, m, layout, tokens, blocks, slow * attention / rate, share, within, hides)
    if config.activation_checkpointing != "none":
        ring_b += ring_f  # selective and full recompute both re-run the ring in backward (`parallel.runtime.cp`)

    counts = _largest_stage_counts(m, layout.stage_layers, layout.pp, layout.vpp, layout.tp, layout.ep,
                                   layout.placement, layout.dp)
    grad_bytes = counts.total * (2 if par.reduce_dtype == "bf16" else 4)
    group = layout.dp * layout.cp  # the ranks that sum the gradients (and that ZeRO shards over): dp x cp
    spans = group * layout.tp > within
    dp_per_node = max(1, min(group, within // layout.tp))  # ranks of one dp group on a node (tp innermost)
    reductions = layout.microbatches if sharding.reduces_every_microbatch else 1
    reduce = reductions * share * machine.collective(sharding.gradient_collective, grad_bytes, group, spans,
                                                     per_node=dp_per_node)
    # behind the backward that made them, unless the ranks' cores are all busy with it (shared CPU cores)
    overlaps = par.overlap_reduce and hides
    hidden = (bwd + tp_b) * layout.vpp * reductions if overlaps else 0.0
    dp_fixed = slow * machine.dp_step_s if group > 1 else 0.0
    elements = sharding.optimizer_elements(counts.total, group)
    context = ExtraContext(layout=layout, config=config, machine=machine, params=counts.total,
                           optimizer_elements=elements, activation_bytes=int(act * blocks * 8), comm_share=share)
    extras = dict(hook(context) for (path, value), hook in OPTION_EXTRAS.items()
                  if option_value(config, path) == value)
    if group > 1:
        extras |= sharding_costs(sharding, machine, layout, counts.total, blocks * layout.vpp, share, slow, spans,
                                 dp_per_node)
    dp_exposed = max(reduce - hidden, 0.0)
    if overlaps and not machine.contention and group > 1:
        # each rank its own device: the reduce-scatters and the prefetched gathers run on the links beside the
        # whole step's compute (FSDP2's and DDP's streams); what is left over, and the first unit's gather,
        # nothing hides
        gather_key = f"zero-{sharding.zero} parameter all-gathers"
        gathers = extras.get(gather_key, 0.0)
        window = (fwd + bwd + tp_f + tp_b) * layout.microbatches * layout.vpp if gathers else hidden
        over = max(reduce + gathers - window, 0.0)
        first = gathers / max(sharding.gathers_per_step(layout.microbatches) * blocks * layout.vpp, 1)
        dp_exposed = over * reduce / (reduce + gathers) if reduce + gathers else 0.0
        if gathers:
            extras[gather_key] = over * gathers / (reduce + gathers) + first
    return StepCosts(forward=fwd + tp_f + ep_f + ring_f, backward=bwd + tp_b + ep_b + ring_b, comm=comm,
                     compute_per_chunk=fwd + bwd, tp_per_chunk=tp_f + tp_b, ep_per_chunk=ep_f + ep_b,
                     cp_per_chunk=ring_f + ring_b,
                     recompute_per_chunk=slow * recompute * (fixed_fwd + seconds),
                     dp_exposed=dp_exposed + dp_fixed,
                     optimizer=slow * (machine.optimizer.time(elements) + machine.step_s), extras=extras,
                     shared=pipeline_sharing(machine, layout.pp, layout.world_size, on_node))


def pipeline_sharing(machine: MachineCosts, pp: int, world: int, on_node: int) -> tuple[float, ...]:
    """`StepCosts.shared` of a pipeline of `pp` stages and `world` ranks that all sit on one node of shared cores
    (`on_node` ranks): with k stages computing, k x world / pp ranks of the node are busy (a stage's replicas and
    shards compute in step), so compute runs at the slowdown of that many over the slowdown of all; () on a node
    of devices or across nodes."""
    slow = machine.slowdown(on_node)
    if pp <= 1 or not machine.contention or slow <= 1.0 or on_node < world:
        return ()
    return tuple(machine.slowdown(k * world // pp) / slow for k in range(1, pp + 1))


def sharing_floor(shared: tuple[float, ...]) -> float:
    """The least a pipeline's busy time can shrink to where its stages share cores (`StepCosts.shared`), as a
    fraction of that time with all stages computing: no compute runs faster than alone (the first entry), and the
    node's ranks together do no more work per second than at the best count of stages busy (the stages' work over
    the most stage-work a second); 1 without sharing (`pipeline_floor`)."""
    if not shared:
        return 1.0
    best = max(k / f for k, f in enumerate(shared, start=1))
    return max(shared[0], len(shared) / best)


def pipeline_floor(shared: tuple[float, ...], busy: float, fill: float, fill_comm: float = 0.0) -> float:
    """At least how long the last pipeline stage takes from the step's start: its own computes (`busy`) after the
    `fill` of computes and the `fill_comm` of hand-overs before its first, each compute at its time with all stages
    computing; where the stages share cores (`StepCosts.shared`), the larger of that with each compute alone and
    all stages' work at the node's best throughput."""
    if not shared:
        return busy + fill + fill_comm
    return max(shared[0] * (busy + fill) + fill_comm, sharing_floor(shared) * busy)


def pipeline_p2p(machine: MachineCosts, nbytes: float, layout: Layout, within: int) -> float:
    """One hand-over between pipeline stages: inside a node while the whole job fits in one, else across nodes
    (stage s's ranks fill a node when dp x cp x tp reaches one)."""
    return p2p_time(machine, nbytes, across=layout.world_size > within)


def p2p_time(machine: MachineCosts, nbytes: float, across: bool) -> float:
    """One point-to-point message inside a node, or across nodes: on the GPU's own NIC where it is known, else at
    `inter_node_factor` of the node's bandwidth."""
    if not across:
        return machine.p2p.time(nbytes)
    if machine.nic_bytes_per_s > 0:
        return machine.p2p.latency_s + machine.across_latency_s + nbytes / min(machine.nic_bytes_per_s,
                                                                              machine.p2p.per_s)
    return machine.p2p.time(nbytes) / machine.inter_node_factor


def ring_costs(machine: MachineCosts, model: ModelConfig, layout: Layout, tokens: int, blocks: int,
               attention_s: float, share: float, within: int, hides: bool) -> tuple[float, float]:
    """(forward, backward) seconds of one chunk's ring exchanges (`parallel.runtime.cp.ring`) beyond what hides
    behind its blocks' attention, for a rank of `tokens` tokens whose `blocks` blocks' attention forward takes
    `attention_s`: at each of the cp - 1 steps of a block's forward the rank sends its neighbour the key/value
    block it holds (fp32, the rank's kv heads, tp splitting them) while computing against it; the backward
    passes the same blocks while computing (the block's backward is about twice its forward), and after each of
    its cp steps shifts the dK/dV accumulators (as large) before going on, which nothing hides. Inside a node while
    the group's cp x tp ranks fit in one. (0, 0) at cp = 1."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    kv_heads = (model.n_kv_head or model.n_head) / layout.tp
    kv = 2 * 4 * tokens * kv_heads * model.head_size  # k and v of the rank's tokens, fp32
    hop = share * p2p_time(machine, kv, across=layout.cp * layout.tp > within)
    step_f = attention_s / max(blocks, 1) / cp  # one block's attention against one key/value block

    def exposed(compute: float) -> float:
        return max(hop - compute, 0.0) if hides else hop

    return blocks * (cp - 1) * exposed(step_f), blocks * ((cp - 1) * exposed(2 * step_f) + cp * hop)


def sharding_costs(sharding: Sharding, machine: MachineCosts, layout: Layout, params: int, blocks: int,
                   share: float, slow: float, spans_nodes: bool = False, per_node: int = 0) -> dict[str, float]:
    """A sharding level's own terms per step beyond the gradients' reduction: its all-gathers of the rank's
    `params` parameter elements (fp32; ZeRO-1 after the step, ZeRO-2 once per chunk, ZeRO-3 around every
    forward and backward), counted whole: a gather after the step has nothing to hide behind, and a prefetched
    one is CPU work on shared cores; and its measured fixed cost for the rank's `blocks` blocks."""
    out: dict[str, float] = {}
    gathers = sharding.gathers_per_step(layout.microbatches)
    if gathers:  # over the replica's dp x cp ranks (what ZeRO shards over)
        out[f"zero-{sharding.zero} parameter all-gathers"] = gathers * share * machine.collective(
            "allgather", 4 * params, layout.dp * layout.cp, spans_nodes, per_node)
    per_step, per_microbatch = machine.zero_fixed.get(str(sharding.zero), (0.0, 0.0))
    if per_step or per_microbatch:
        out[f"zero-{sharding.zero} fixed"] = slow * blocks * (per_step + layout.microbatches * per_microbatch)
    return out


def fixed_costs(machine: MachineCosts, blocks: int, tp: int, sp: bool, pp: int = 1) -> tuple[float, float]:
    """(forward, backward) fixed seconds of one chunk of `blocks` blocks for one micro-batch on one rank alone:
    the measured per-chunk and per-block costs, with tensor (and sequence) parallelism's extra per block and a
    pipeline's extra per chunk."""
    per_block = machine.block_s + (machine.tp_block_s + (machine.sp_block_s if sp else 0.0) if tp > 1 else 0.0)
    total = machine.microbatch_s + (machine.pp_microbatch_s if pp > 1 else 0.0) + max(blocks, 1) * per_block
    return (1 - machine.backward_share) * total, machine.backward_share * total


@functools.lru_cache(maxsize=4096)
def _largest_stage_counts(model: ModelConfig, stage_layers: tuple, pp: int, vpp: int, tp: int, ep: int, placement: str,
                          dp: int) -> ParamCounts:
    """The local parameter counts of the largest of the embedding's, a middle and the head's pipeline stage (cached:
    the planner asks for every variant of the same degrees)."""
    layout = Layout(dp=dp, pp=pp, tp=tp, ep=ep, vpp=vpp, stage_layers=stage_layers, placement=placement)
    sizing = Sizing(JobConfig(model=model, steps=1, global_batch=dp), layout=layout)
    stages = dict.fromkeys((0, pp // 2, pp - 1))
    return max((param_counts(sizing, p) for p in stages), key=lambda c: c.total)


@functools.lru_cache(maxsize=1024)
def _flops_per_token(model: ModelConfig) -> float:
    return _family_of(model).flops_per_token(model)


def _family_of(model: ModelConfig):
    from trainyard.parallel.models import family_of

    return family_of(model)


def ratio_key(value: float) -> float:
    """A cost ratio rounded to two significant digits (the simulator cache's key)."""
    if value <= 0:
        return 0.0
    digits = 1 - math.floor(math.log10(value))
    return round(value, digits)
