"""The cost model: a laid-out job's step time from measured machine costs, term by term.

`MachineCosts` holds what a calibration run measured on one node type (`parallel.runtime.calibrate`): the rate
the trainer runs a model's FLOPs at, by width (and a matmul's, as latency + FLOPs / throughput), the all-reduce,
point-to-point, all-to-all, all-gather and reduce-scatter times as latency + bytes / bandwidth (alpha-beta), the
optimizer's time per parameter element, the trainer's fixed costs (per block and per chunk of each micro-batch, per
step, the extra per block of tensor parallelism's DTensors and of sequence parallelism, and of each ZeRO level's
FSDP2 machinery), and how much slower compute runs when k ranks share one node (`contention`: ranks sharing CPU
cores; 1 where each rank has its own device). `step_costs(layout, config, machine)` turns a layout into the
per-chunk forward / backward / point-to-point costs the schedule simulator takes plus the terms outside the
pipeline (the data-parallel reduction not hidden behind backward, the optimizer step, the options' own extras);
`parallel.plan.planner` simulates the schedule with them and adds the rest.

What is written by hand and why: the FLOPs of a chunk come from the family's `flops_per_token` (6 N + 12 L d T),
shared out over the blocks; the collectives' message sizes are Megatron's (two activation all-reduces per block
forward and two in backward under tp; two all-to-alls per MoE block each way under ep; one activation per
micro-batch between pipeline stages; every local gradient once per step over dp, or as the `parallel.plan.sharding`
strategy says: reduce-scattered once or every micro-batch, the parameters all-gathered after the step, once per
chunk or around every forward and backward, in `sharding_costs`). Options that change the time in their own way are
one line each in `OPTION_EXTRAS` (an offload adds its entry there). The fixed costs and the contention are
measured, not written here; before a node type is calibrated (`default_gpu_costs`) a block's fixed cost is
OPS_PER_BLOCK kernels' latency. On a node whose ranks share CPU cores (a measured `contention`), a collective is
CPU work on those same cores: it is slowed as compute is, by the node's slowdown over the one it was measured at
(`comm_share`), and the data-parallel reduction hides behind nothing, since no core is idle to run it during the
backward (on this 2-core machine 4 ranks measured up to 2.6x their prediction before: BENCHMARKS.md, section
`planner`); a pipeline's stages are not all busy at once, so its simulation speeds a compute up by how many
compute beside it (`pipeline_sharing`; a stage waiting in the bubble lends the others its core). A tensor-parallel
shard's FLOPs run at the rate of a model as wide as the shard (narrower matrices, and the norms and residuals stay
whole on every shard). Ignored: kernel fusion and overlap inside a chunk, stragglers, contention between groups
sharing a link, the first step's warm-up. Pure arithmetic: no torch."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from trainyard.parallel.config import JobConfig, ModelConfig
from trainyard.parallel.plan.layout import Layout
from trainyard.parallel.plan.memory import ParamCounts, param_counts
from trainyard.parallel.plan.sharding import Sharding, sharding_for
from trainyard.parallel.plan.sizing import Sizing

OPS_PER_BLOCK = 16
"""Kernels (matmuls, norms, activations, adds) one block forward launches (forward and backward: 3x): the
fixed cost of a block on a node type not calibrated yet (`default_gpu_costs`)."""
RECOMPUTE_EXTRA = {"none": 0.0, "selective": 0.15, "full": 1.0}
"""Forwards re-run in backward per `activation_checkpointing` mode, as a fraction of the forward (an unknown
mode: a whole forward)."""


@dataclass(frozen=True)
class Fit:
    """time = latency_s + size / per_s (size: bytes, FLOPs or elements; fitted by least squares)."""

    latency_s: float
    per_s: float

    def time(self, size: float) -> float:
        return self.latency_s + size / self.per_s if size > 0 else 0.0

    @staticmethod
    def fit(points: list[tuple[float, float]]) -> Fit:
        """Least squares of (size, seconds); latency clamped at 0, throughput at a positive value."""
        n = len(points)
        mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
        if slope <= 0:  # flat (noise): all latency, a throughput from the largest size
            x, y = max(points)
            return Fit(latency_s=max(my, 0.0), per_s=x / max(y, 1e-12) * 1e3)
        return Fit(latency_s=max(my - slope * mx, 0.0), per_s=1.0 / slope)


@dataclass(frozen=True)
class MachineCosts:
    """One node type's measured costs (`parallel.runtime.calibrate` measures them; JSON via to_dict/from_dict)."""

    node_type: str
    matmul: Fit
    """One matmul: latency + FLOPs / FLOP/s (one device, the thread count a rank gets)."""
    allreduce: Fit
    """An all-reduce of `world` ranks: latency + bytes / bytes/s."""
    p2p: Fit
    """One point-to-point message."""
    alltoall: Fit
    """An all-to-all of `world` ranks, by the bytes each rank holds."""
    optimizer: Fit
    """The optimizer step, by parameter elements."""
    world: int = 2
    """Ranks the collectives were measured with."""
    inter_node_factor: float = 1.0
    """Bandwidth between nodes / within one (a group spanning nodes is this much slower; 1: unmeasured)."""
    measured: dict = field(default_factory=dict)
    """The raw points each fit came from."""
    block_s: float = 0.0
    """Fixed seconds of one block's forward and backward for one micro-batch on one rank alone (Python, kernel
    launches, autograd: what a tiny model's step costs per block), beyond its FLOPs."""
    microbatch_s: float = 0.0
    """Fixed seconds of one chunk's forward and backward for one micro-batch beyond its blocks (the executor's
    actions, embedding, head and loss at no size)."""
    step_s: float = 0.0
    """Fixed seconds of a step beyond its micro-batches (zeroing, clipping, the optimizer's launch, the loss)."""
    tp_block_s: float = 0.0
    """Extra fixed seconds per block and micro-batch at tp > 1 (DTensor's per-op cost and its collectives'
    latency, as measured on a tiny model at tp = 2), beyond the collectives' bytes / bandwidth."""
    sp_block_s: float = 0.0
    """Extra fixed seconds per block and micro-batch of sequence parallelism on top of tp_block_s."""
    pp_microbatch_s: float = 0.0
    """Extra fixed seconds per chunk and micro-batch at pp > 1 (the executor's hand-overs and their waits, as
    measured on a tiny model at pp = 2), beyond the point-to-point messages' own time."""
    dp_step_s: float = 0.0
    """Extra fixed seconds per step at dp > 1 (the gradient reduction's buckets, hooks and waits for the peers,
    as measured on a tiny model at dp = 2), beyond the all-reduces' own time."""
    backward_share: float = 2 / 3
    """The part of the fixed costs spent in backward (the rest in forward)."""
    contention: tuple[float, ...] = ()
    """Compute's slowdown with k = 1, 2, ... ranks busy on one node at once (index k - 1), over one rank
    alone; () or past the end: 1 (each rank has its own device) or proportionally from the last."""
    allgather: Fit | None = None
    """An all-gather of `world` ranks, by the bytes gathered (the whole tensor); None (not measured): half an
    all-reduce's traffic."""
    reducescatter: Fit | None = None
    """A reduce-scatter of `world` ranks, by the bytes reduced (the whole tensor); None: as the all-gather."""
    token_efficiency: tuple[tuple[float, float], ...] = ()
    """(tokens per micro-batch, rate over the rate at the widths' token count) pairs, ascending: smaller
    micro-batches run their FLOPs slower (thinner matmuls); () or past the last: 1."""
    comm_contention: tuple[float, ...] = ()
    """An all-reduce's measured time with k = 1, 2, ... ranks of one node in it (index k - 1) over what the fit
    measured at `world` ranks predicts for k by its ring traffic (on shared CPU cores gloo's copies and wake-ups
    are CPU work that more ranks than cores wait on); () (not measured): as compute's slowdown."""
    model_flops: tuple[tuple[float, float], ...] = ()
    """(d_model, FLOP/s) pairs, widths ascending: the rate the trainer runs a model's FLOPs at on one rank alone,
    measured on models of a few widths (every kernel of a step: matmuls, attention, norms, autograd); () (not
    measured): the matmul's."""
    zero_fixed: dict[str, tuple[float, float]] = field(default_factory=dict)
    """A sharding level's extra fixed seconds over plain data parallelism, `str(zero)` -> (per block and step, per
    block and micro-batch), beyond its collectives' own time, as measured on tiny models at dp = 2 (FSDP2's
    hooks, copies and the optimizer's step on DTensors); a level not here: none."""

    def slowdown(self, ranks: int) -> float:
        """How much slower compute runs with `ranks` ranks on one node than with one (at least 1)."""
        if not self.contention or ranks <= 1:
            return 1.0
        if ranks <= len(self.contention):
            return max(self.contention[ranks - 1], 1.0)
        return max(self.contention[-1] * ranks / len(self.contention), 1.0)

    def flops_per_s(self, d_model: float, tokens: int = 0) -> float:
        """The rate a model `d_model` wide runs its FLOPs at, with `tokens` per micro-batch (0: as many as the
        widths were measured at): log-linear between the measured widths and token counts, the nearest beyond
        them; the matmul's when no width was measured."""
        if not self.model_flops:
            return self.matmul.per_s
        rate = _log_linear(self.model_flops, d_model)
        return rate * _log_linear(self.token_efficiency, tokens) if self.token_efficiency and tokens else rate

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> MachineCosts:
        fits: dict[str, Any] = {k: Fit(**d[k]) for k in ("matmul", "allreduce", "p2p", "alltoall", "optimizer")}
        fits |= {k: Fit(**d[k]) for k in ("allgather", "reducescatter") if d.get(k)}
        fixed = {k: d[k] for k in ("block_s", "microbatch_s", "step_s", "tp_block_s", "sp_block_s", "pp_microbatch_s",
                                   "dp_step_s", "backward_share") if k in d}
        zero_fixed = {level: (float(a), float(b)) for level, (a, b) in d.get("zero_fixed", {}).items()}
        model_flops = tuple((float(w), float(r)) for w, r in d.get("model_flops", ()))
        token_efficiency = tuple((float(t), float(e)) for t, e in d.get("token_efficiency", ()))
        if d.get("comm_contention"):
            fixed["comm_contention"] = tuple(d["comm_contention"])
        return MachineCosts(node_type=d["node_type"], world=d.get("world", 2),
                            inter_node_factor=d.get("inter_node_factor", 1.0), measured=d.get("measured", {}),
                            contention=tuple(d.get("contention", ())), zero_fixed=zero_fixed,
                            model_flops=model_flops, token_efficiency=token_efficiency, **fixed, **fits)

    def comm_share(self, ranks: int) -> float:
        """How much slower collectives run with `ranks` ranks on one node than at the world they were measured
        at: as measured (`comm_contention`), else on shared CPU cores as compute is (1 where each rank has its
        own device)."""
        measured = self.comm_contention
        if measured and ranks > self.world:
            at = measured[ranks - 1] if ranks <= len(measured) else measured[-1] * ranks / len(measured)
            return max(at, 1.0)
        return self.slowdown(ranks) / self.slowdown(self.world) if self.contention else 1.0

    def collective(self, kind: str, nbytes: float, n: int, spans_nodes: bool = False) -> float:
        """One collective of `n` ranks over `nbytes` (a rank's whole tensor: the reduced, gathered or sent one),
        scaled from the measured world by the ring's traffic: all-reduce 2(n-1)/n, all-to-all, all-gather and
        reduce-scatter (n-1)/n."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        gather = self.allgather if kind == "allgather" else self.reducescatter or self.allgather
        measured = {"allreduce": self.allreduce, "alltoall": self.alltoall}.get(kind, gather)
        base = measured or self.allreduce  # a gather or scatter not measured: from the all-reduce
        w = max(self.world, 2)
        traffic = {"allreduce": 2}.get(kind, 1)
        measured_traffic = (2 if kind == "allreduce" or measured is None else 1) * (w - 1) / w
        bus = base.per_s * measured_traffic * (self.inter_node_factor if spans_nodes else 1.0)
        return base.latency_s * (n - 1) / (w - 1) + traffic * (n - 1) / n * nbytes / bus


def _log_linear(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at x, log-linear between (x, y) points ascending in x; the nearest point's y beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            at = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + at * (math.log(y1) - math.log(y0)))
    return points[-1][1]


def default_gpu_costs(node_type: str = "unmeasured GPU") -> MachineCosts:
    """Costs to plan with before a calibration ran on a GPU node type (H100-like orders of magnitude)."""
    return MachineCosts(node_type=node_type, matmul=Fit(10e-6, 400e12), allreduce=Fit(30e-6, 150e9),
                        p2p=Fit(20e-6, 100e9), alltoall=Fit(30e-6, 100e9), optimizer=Fit(50e-6, 2e10),
                        world=8, inter_node_factor=0.15, block_s=3 * OPS_PER_BLOCK * 10e-6)


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
    shared: tuple[float, ...] = ()
    """Where a pipeline's ranks share one node's cores: a chunk's forward or backward time with k of the pp stages
    computing at once (index k - 1) over its time above, with all of them computing (`schedule_sim.Costs.shared`:
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
    m, par = config.model, config.fixed_parallel
    tokens = layout.micro_batch_size * m.seq_len
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
    fwd = slow * (fixed_fwd + flops / rate)
    bwd = slow * (fixed_bwd + recompute * fixed_fwd + (2 + recompute) * flops / rate)

    within = node_gpus or layout.world_size
    act = tokens * m.d_model * act_bytes
    tp_one = share * machine.collective("allreduce", act, layout.tp, spans_nodes=layout.tp > within)
    tp_f, tp_b = 2 * blocks * tp_one, (2 + 2 * (recompute >= 1)) * blocks * tp_one
    moe_blocks = sum(m.is_moe_block(b) for b in layout.stage_layers[heaviest]) if layout.stage_layers else 0
    ep_one = 0.0
    if m.moe is not None and layout.ep > 1:
        sent = tokens / layout.tp * m.moe.top_k * m.d_model * act_bytes
        ep_one = share * machine.collective("alltoall", sent, layout.ep, spans_nodes=layout.ep * layout.tp > within)
    ep_f, ep_b = 2 * moe_blocks * ep_one, 2 * moe_blocks * ep_one
    message = act / layout.tp if par.sp else act
    comm = share * machine.p2p.time(message) * (1 if layout.dp * layout.tp * layout.pp <= within else 1 / machine
                                        .inter_node_factor) if layout.pp > 1 else 0.0

    counts = _largest_stage_counts(m, layout.stage_layers, layout.pp, layout.vpp, layout.tp, layout.ep,
                                   layout.placement, layout.dp)
    grad_bytes = counts.total * (2 if par.reduce_dtype == "bf16" else 4)
    sharding = sharding_for(par.zero)
    spans = layout.dp * layout.tp > within
    reductions = layout.microbatches if sharding.reduces_every_microbatch else 1
    reduce = reductions * share * machine.collective(sharding.gradient_collective, grad_bytes, layout.dp, spans)
    # behind the backward that made them, unless the ranks' cores are all busy with it (shared CPU cores)
    overlaps = par.overlap_reduce and not (machine.contention and slow > 1.0)
    hidden = (bwd + tp_b) * layout.vpp * reductions if overlaps else 0.0
    dp_fixed = slow * machine.dp_step_s if layout.dp > 1 else 0.0
    elements = sharding.optimizer_elements(counts.total, layout.dp)
    context = ExtraContext(layout=layout, config=config, machine=machine, params=counts.total,
                           optimizer_elements=elements, activation_bytes=int(act * blocks * 8), comm_share=share)
    extras = dict(hook(context) for (path, value), hook in OPTION_EXTRAS.items()
                  if option_value(config, path) == value)
    if layout.dp > 1:
        extras |= sharding_costs(sharding, machine, layout, counts.total, blocks * layout.vpp, share, slow, spans)
    return StepCosts(forward=fwd + tp_f + ep_f, backward=bwd + tp_b + ep_b, comm=comm, compute_per_chunk=fwd + bwd,
                     tp_per_chunk=tp_f + tp_b, ep_per_chunk=ep_f + ep_b,
                     dp_exposed=max(reduce - hidden, 0.0) + dp_fixed,
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


def sharding_costs(sharding: Sharding, machine: MachineCosts, layout: Layout, params: int, blocks: int,
                   share: float, slow: float, spans_nodes: bool = False) -> dict[str, float]:
    """A sharding level's own terms per step beyond the gradients' reduction: its all-gathers of the rank's
    `params` parameter elements (fp32; ZeRO-1 after the step, ZeRO-2 once per chunk, ZeRO-3 around every
    forward and backward), counted whole: a gather after the step has nothing to hide behind, and a prefetched
    one is CPU work on shared cores; and its measured fixed cost for the rank's `blocks` blocks."""
    out: dict[str, float] = {}
    gathers = sharding.gathers_per_step(layout.microbatches)
    if gathers:
        out[f"zero-{sharding.zero} parameter all-gathers"] = gathers * share * machine.collective(
            "allgather", 4 * params, layout.dp, spans_nodes)
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
    sizing = Sizing(layout, JobConfig(model=model, steps=1, global_batch=dp))
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
