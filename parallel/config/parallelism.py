"""The JobSpec's layout and run-time sections: `parallel` (degrees, schedule, ZeRO, elastic dp, gradient
compression, replica sync), `fault`, `resources` and `sim_costs`.

Part of the JobSpec (`parallel.config` re-exports every name); the docstring under each field is its
description in docs/jobspec.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from trainyard.parallel.config.fields import MAX_GLOBAL_BATCH, MAX_STEPS, NOT_BOOL, STRICT, Degree, RuleError, Steps
from trainyard.parallel.names import CompressionName, ConsistencyName, ScheduleKind, SyncName, ZeroLevel


@dataclass(frozen=True, kw_only=True)
class DpRange:
    """An elastic data-parallel size: the job starts once `min` replicas fit, grows (up to `max`) when free
    resources appear and shrinks (down to `min`) when a node is lost."""

    __pydantic_config__ = STRICT
    min: Degree
    """Replicas the job starts with (once they fit) and never shrinks below."""
    max: Degree
    """Replicas the job grows to at most, when free resources appear."""


@dataclass(frozen=True, kw_only=True)
class GradCompressionConfig:
    """A compressor on the data-parallel reduction (`parallel.runtime.compression`): powersgd (Vogels et al. 2019,
    each large enough gradient matrix sent as two rank-`rank` factors, with error feedback), topk (Aji & Heafield
    2017, each matrix's `ratio` largest elements, the rest carried to the next step) or qsgd (Alistarh et al.
    2017, each matrix stochastically rounded to `levels` levels of its norm, unbiased). 1-D tensors go whole."""

    __pydantic_config__ = STRICT
    kind: CompressionName = "powersgd"
    """The compressor: powersgd, topk or qsgd."""
    rank: Annotated[int, Gt(0), Le(4096), NOT_BOOL] = 4
    """powersgd: rank of the approximation of each gradient matrix (a matrix of min(rows, cols) <= rank is exact)."""
    warmup_steps: Steps = 0
    """Steps reduced uncompressed first (the gradients change fastest early; torch's start_powerSGD_iter)."""
    min_compression_rate: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] = 2.0
    """powersgd: a matrix is compressed only when its elements exceed (rows + cols) x rank by this factor (torch's
    default 2); the others, and every 1-D tensor, are reduced uncompressed. 0 compresses every matrix."""
    ratio: Annotated[float, Gt(0), Le(1), NOT_BOOL] = 0.01
    """topk: the share of each gradient matrix's elements a rank sends, the largest by magnitude (k = ceil(ratio x
    elements)), as int32 index and fp32 value pairs; 1 sends every element (the exact sum)."""
    error_feedback: bool = True
    """topk: keep what a rank did not send and add it to its next gradient (Aji & Heafield's residual); false drops
    it."""
    levels: Annotated[int, Ge(1), Le(127), NOT_BOOL] = 7
    """qsgd: the levels s of |g| / ||g|| (stochastic rounding to l / s); a code takes 2, 4 or 8 bits (sign and level:
    s <= 1, 7, 127), 7 is 4-bit QSGD."""
    bucket_size: Annotated[int, Gt(0), Le(1 << 30), NOT_BOOL] = 512
    """qsgd: consecutive elements of a matrix quantized against one fp32 norm (the paper's bucket size d: the
    variance grows with it, as min(d / s^2, sqrt(d) / s) x ||g||^2)."""


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """How data-parallel replicas (each a whole pp x tp group of one or `replicas` dp ranks) keep in step
    (`parallel.sync`)."""

    __pydantic_config__ = STRICT
    kind: SyncName = "allreduce"
    """allreduce: gradients summed every step; local_sgd: each replica steps on its own share of the batch and
    the parameters are averaged every `every` steps; diloco: the averaged change since the last sync (the
    pseudo-gradient) goes through an outer Nesterov SGD; gossip: every `every` steps each replica averages its
    parameters with `peers` others only, by point-to-point messages (`parallel.runtime.sync`); parameter_server: the
    replicas push their gradients to `shards` server actors, which own the parameters and the optimizer state, and
    pull the parameters back (`consistency`)."""
    every: Annotated[int, Gt(0), Le(MAX_STEPS), NOT_BOOL] = 1
    """local_sgd, diloco, gossip: steps between synchronisations (H)."""
    outer_lr: Annotated[float, Gt(0), Le(1e3), NOT_BOOL] = 0.7
    """diloco: the outer SGD's learning rate (DiLoCo's 0.7)."""
    outer_momentum: Annotated[float, Ge(0), Lt(1), NOT_BOOL] = 0.9
    """diloco: the outer SGD's Nesterov momentum (0: plain SGD)."""
    peers: Degree = 1
    """gossip: how many other replicas each replica averages with at a sync (fewer than the replicas; with an odd
    number, the replicas must be even: each exchange pairs two). The replicas' number less one: local_sgd's mean."""
    topology: Literal["ring", "random"] = "ring"
    """gossip: who the peers are: `ring`, the nearest replicas by index (one peer: the left and the right
    neighbour in turn); `random`, the same over a permutation drawn from (seed, step), new at every sync
    (`parallel.plan.sync.gossip_peers`)."""
    replicas: Degree | None = None
    """local_sgd, diloco, gossip: how many replicas the data-parallel ranks form (it must divide dp); each replica
    is then dp / replicas consecutive dp ranks, which share ZeRO's shards and MoE's experts and sum their gradients
    every step, as allreduce's ranks do. Default: dp (each data-parallel rank a replica)."""
    consistency: ConsistencyName = "bsp"
    """parameter_server: bsp, the server applies the replicas' mean gradient once per step, every replica waiting
    for all; asp, it applies each replica's push as it arrives, no one waits; ssp, as asp, but a replica starts step
    t only once every replica has finished step t - 1 - `staleness` (`parallel.plan.sync.parameter_server`)."""
    staleness: Annotated[int, Ge(0), Le(MAX_STEPS), NOT_BOOL] = 0
    """parameter_server with ssp: how many steps a replica may run ahead of the slowest (s; 0 is lockstep)."""
    shards: Annotated[int, Gt(0), Le(1024), NOT_BOOL] = 1
    """parameter_server: server actors, each owning a share of the parameters (by size) and their optimizer
    state."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    __pydantic_config__ = STRICT
    dp: Degree | DpRange = 1
    """Data-parallel replicas, or a range {min, max} to scale within (`microbatches` is then per rank at
    `min`, raised at submit where `max` needs a smaller micro-batch to split the global batch; the global batch
    and the micro-batch stay the same at every size)."""
    pp: Degree = 1
    """Pipeline stages (pipeline ranks)."""
    tp: Degree = 1
    """Tensor-parallel shards."""
    ep: Degree = 1
    """Expert-parallel ranks, carved out of dp: each hosts experts / ep experts of every MoE layer."""
    cp: Degree = 1
    """Context-parallel ranks inside each replica: every sequence split over them (rank i of the group holds chunks i
    and 2cp-1-i, head-tail balanced), causal attention by a ring of key/value blocks (`parallel.runtime.cp`). The
    gradients are summed over dp x cp, and ZeRO shards over dp x cp too. Not yet with MoE, local_sgd / diloco or
    compile (a 422)."""
    vpp: Degree = 1
    """Virtual pipeline chunks per pipeline rank (interleaved-1f1b; zbv needs 2)."""
    sp: bool = False
    """Sequence parallelism (with tp)."""
    microbatches: Annotated[int, Gt(0), Le(MAX_GLOBAL_BATCH), NOT_BOOL] = 1
    """Micro-batches per step on each data-parallel rank (gradient accumulation, pipeline depth)."""
    schedule: ScheduleKind = "1f1b"
    """Pipeline schedule."""
    stage_layers: Annotated[list[Annotated[int, Gt(0), Le(4096), NOT_BOOL]], MinLen(1), MaxLen(4096)] | None = None
    """Blocks per virtual stage, in order (pp * vpp entries summing to n_layer); null splits evenly."""
    zero: Annotated[ZeroLevel, NOT_BOOL] = 0
    """1: ZeRO-1, each data-parallel rank keeps the optimizer state of its shard of the parameters only
    (gradients reduce-scattered, parameters all-gathered after the step); 2: ZeRO-2, the reduced gradients
    too; 3: ZeRO-3, the parameters too, gathered one block at a time around its forward and backward."""
    overlap_reduce: bool = True
    """Start each gradient bucket's reduction during backward, as soon as its gradients are final."""
    shared_memory_reduce: bool = True
    """Sum the gradients through shared memory when the ranks of a group are CPU processes on one host (gloo's only
    transport is TCP); nothing then overlaps backward. false: gloo's all-reduce, overlapped as overlap_reduce says."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Type of the gradients on the wire between data-parallel ranks; bf16 halves the traffic."""
    grad_compression: GradCompressionConfig | None = None
    """Compress the gradients on the wire (`{kind: powersgd, rank: 4, warmup_steps: 10}`, `{kind: topk, ratio: 0.01}`,
    `{kind: qsgd, levels: 7}`); null: none."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """How the replicas keep in step: every step (allreduce), every H steps (local_sgd, diloco, gossip), or through
    server shards that own the parameters (parameter_server: BSP, SSP, ASP)."""

    @property
    def fixed_dp(self) -> int:
        """`dp` of a layout at one size: a plan's (`parallel.plan.resized` fixes an elastic job's before it is laid
        out) or a candidate the planner made."""
        if isinstance(self.dp, DpRange):
            raise RuleError("parallel.dp", f"an elastic dp ({self.dp.min} to {self.dp.max}) has no one size here: "
                                           "parallel.plan.resized fixes it first")
        return self.dp


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    __pydantic_config__ = STRICT
    max_failures: Annotated[int, Ge(0), Le(1000), NOT_BOOL] = 3
    """Failures (a rank that raises, dies or hangs) the job recovers from, each from a live replica's state or
    its latest checkpoint; the next one fails the job. 0: the first failure fails the job (a deterministic
    error is then not retried)."""
    step_timeout_s: Annotated[float, Gt(0), Le(7 * 24 * 3600), NOT_BOOL] = 300.0
    """A step that takes longer has hung, whatever its history (a hung collective never hangs the service)."""
    hang_factor: Annotated[float, Gt(1), Le(1e4), NOT_BOOL] = 10.0
    """After a few steps, a step longer than hang_factor x the median of the recent ones has hung..."""
    hang_floor_s: Annotated[float, Gt(0), Le(7 * 24 * 3600), NOT_BOOL] = 5.0
    """...and longer than this: short steps vary too much for a ratio alone."""
    node_grace_s: Annotated[float, Ge(0), Le(7 * 24 * 3600), NOT_BOOL] = 30.0
    """How long the resources of a lost node may take to come back (a node added back, or room elsewhere) before an
    elastic job shrinks to the replicas left and a fixed-size one fails, naming the node."""
    grow_interval_s: Annotated[float, Gt(0), Le(7 * 24 * 3600), NOT_BOOL] = 10.0
    """Elastic jobs below their max: how often to look for free resources to grow into."""
    from_replica: bool = True
    """Recover from a live data-parallel replica when every (pp, tp) shard still has one holding the state of
    the failed step (no step lost, no checkpoint needed); else, and with false, from the latest checkpoint."""


@dataclass(frozen=True, kw_only=True)
class ResourcesConfig:
    __pydantic_config__ = STRICT
    gpus_per_worker: Literal["auto"] | Annotated[int, Ge(0), Le(64), NOT_BOOL] = "auto"
    """auto: 1 if the cluster has GPUs, else 0."""
    cpus_per_worker: Annotated[float, Ge(0.0001), Le(4096), NOT_BOOL] = 1.0  # Ray counts resources in 0.0001 units
    """Logical CPUs each rank reserves (also its torch thread count, at least 1)."""


@dataclass(frozen=True, kw_only=True)
class SimCostsConfig:
    __pydantic_config__ = STRICT
    forward: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] = 1.0
    """Simulated time of one forward of one chunk."""
    backward: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] = 2.0
    """Simulated time of one backward of one chunk."""
    comm: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] = 0.0
    """Simulated time of one communication run (a batch of point-to-point messages sent together)."""
    backward_weight: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] | None = None
    """Of `backward`, the time of the weight-gradient part (a zero-bubble schedule's W; null: half of it); the
    input-gradient part (I) takes the rest, so it must not exceed `backward`."""
