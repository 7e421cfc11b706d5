"""The plan: one frozen object describing how a job is laid out, computed once from the JobConfig.

`make_plan(config, cluster)` raises the first rule the config breaks (`parallel.plan.rules`: each error names the
field and the rule, and the API returns it as a 422), lays the job out (`parallel.plan.layout`: degrees, rank
grid, process groups, the layers of each pipeline stage, the schedule, the resources each worker needs)
and, given a cluster, refuses a job it could never hold (`parallel.plan.admission`: resources and memory).
A `Plan` is that layout with its config, and each strategy the config names resolved once
(`parallel.plan.sizing.Resolved`): `plan.parallel` (the layout written out: `auto` is resolved before a plan is
made), `plan.sharding`, `plan.schedule` (the kind; `plan.actions` its action lists), `plan.optimizer`,
`plan.family`. Everything after it receives the Plan and never re-derives layout nor looks a name up again.
Presentation (`describe`) is `parallel.plan.present`'s. Pure: no I/O, no torch.

Modules, each importing only those before it: schedules, sharding -> layout -> sizing (the strategies resolved) ->
reduction sets -> memory -> rules -> admission (and units) -> plan -> present (tests/unit/test_imports.py keeps it
acyclic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from trainyard.parallel.config import DpRange, JobConfig
from trainyard.parallel.plan.admission import ClusterResources, NodeResources, fit_violations, memory_violations
from trainyard.parallel.plan.layout import Gang, Layout, RankCoords, even_layer_counts, stage_layers_of
from trainyard.parallel.plan.memory.estimate import RankMemory, estimate
from trainyard.parallel.plan.rules import (
    MAX_SCHEDULE_CHUNKS,
    MAX_WORKERS,
    PlanError,
    degree_violations,
    stage_layer_violations,
)
from trainyard.parallel.plan.sizing import Sizing, fixed_parallel
from trainyard.parallel.plan.sync.replica_sync import layout_replica_dp, resize_refusal

__all__ = ["MAX_SCHEDULE_CHUNKS", "MAX_WORKERS", "ClusterResources", "Gang", "Layout", "NodeResources", "Plan",
           "PlanError", "RankCoords", "can_move_in_memory", "dp_range", "layout_of", "make_plan", "reaching_max",
           "resized", "split_layers"]


@dataclass(frozen=True)
class Plan(Sizing):
    """A job laid out: `config`, its `layout`, and the strategies resolved from the config (`Resolved`)."""

    dp_range: tuple[int, int] | None = field(default=None, kw_only=True)
    """An elastic job's (min, max) data-parallel size; `config` and `dp` are its current size."""

    # The layout's answers, asked of the plan (the layout is the plan without its config).
    dp = property(lambda self: self.layout.dp)
    pp = property(lambda self: self.layout.pp)
    tp = property(lambda self: self.layout.tp)
    ep = property(lambda self: self.layout.ep)
    cp = property(lambda self: self.layout.cp)
    vpp = property(lambda self: self.layout.vpp)
    microbatches = property(lambda self: self.layout.microbatches)
    micro_batch_size = property(lambda self: self.layout.micro_batch_size, doc="Sequences per micro-batch on one "
                                                                               "data-parallel rank.")
    ranks = property(lambda self: self.layout.ranks)
    stage_layers = property(lambda self: self.layout.stage_layers, doc="Global block indices of each virtual stage.")
    placement = property(lambda self: self.layout.placement, doc="How virtual stages sit on the ranks.")
    actions = property(lambda self: self.layout.actions, doc="Each pipeline rank's action list, index = pp rank (the "
                                                               "kind that built them: `schedule`).")
    gpus_per_worker = property(lambda self: self.layout.gpus_per_worker)
    cpus_per_worker = property(lambda self: self.layout.cpus_per_worker)
    world_size = property(lambda self: self.layout.world_size)
    n_virtual_stages = property(lambda self: self.layout.n_virtual_stages)
    gang = property(lambda self: self.layout.gang)

    def rank_of(self, pp: int, tp: int, dp: int, cp: int = 0) -> int:
        return self.layout.rank_of(pp, tp, dp, cp)

    def coords(self, rank: int) -> RankCoords:
        return self.layout.coords(rank)

    def dp_groups(self) -> list[list[int]]:
        return self.layout.dp_groups()

    def pp_groups(self) -> list[list[int]]:
        return self.layout.pp_groups()

    def cp_groups(self) -> list[list[int]]:
        return self.layout.cp_groups()

    def cross_replica_groups(self) -> list[list[int]]:
        return self.layout.cross_replica_groups()

    @property
    def reduce_dp(self) -> int:
        return self.layout.reduce_dp

    def tp_groups(self) -> list[list[int]]:
        return self.layout.tp_groups()

    def ep_rank(self, rank: int) -> int:
        return self.layout.ep_rank(rank)

    def ep_groups(self) -> list[list[int]]:
        return self.layout.ep_groups()

    def expert_groups(self) -> list[list[int]]:
        return self.layout.expert_groups()

    def stage_groups(self) -> list[list[int]]:
        return self.layout.stage_groups()

    def experts_of(self, rank: int) -> range:
        return self.layout.experts_of(rank)

    def tied_groups(self) -> list[list[int]]:
        return self.layout.tied_groups()

    def chunk_layers(self, pp_rank: int) -> list[tuple[int, ...]]:
        return self.layout.chunk_layers(pp_rank)

    def bundle_of(self, rank: int) -> int:
        return self.layout.bundle_of(rank)

    def worker_name(self, rank: int) -> str:
        return self.layout.worker_name(rank)

    def bundles(self) -> list[dict[str, float]]:
        return self.layout.bundles()

    def resources_needed(self) -> dict[str, float]:
        return self.layout.resources_needed()

    def memory(self) -> list[RankMemory]:
        """Every rank's estimated memory (`parallel.plan.memory.estimate.estimate`), index = rank."""
        return estimate(self.layout, self.config)


def dp_range(config: JobConfig) -> tuple[int, int] | None:
    """(min, max) of an elastic job, None for a fixed size."""
    dp = fixed_parallel(config).dp
    return (dp.min, dp.max) if isinstance(dp, DpRange) else None


def resized(config: JobConfig, dp: int) -> JobConfig:
    """The job at `dp` data-parallel replicas: the same global batch in micro-batches of the same size, so
    only the micro-batches per rank change (and the loss curve does not). Raises PlanError naming the rule
    when the global batch cannot be split that way, or `dp` is outside an elastic job's range; `make_plan`
    checks the rest. The result has a fixed dp (an elastic plan keeps its range in `Plan.dp_range`)."""
    par, limits = fixed_parallel(config), dp_range(config)
    if limits is not None and not limits[0] <= dp <= limits[1]:
        raise PlanError("parallel.dp", f"dp={dp} is outside the job's range parallel.dp = {{min: {limits[0]}, "
                              f"max: {limits[1]}}}")
    size = config.global_batch // ((par.fixed_dp if limits is None else limits[0]) * par.microbatches)
    microbatches, rem = divmod(config.global_batch, dp * size) if size else (0, 1)
    if dp < 1 or rem or microbatches < 1:
        raise PlanError("parallel.dp", f"dp={dp}: global_batch={config.global_batch} in micro-batches of {size} "
                                       f"sequences cannot be split evenly over {dp} data-parallel ranks "
                                       f"({config.global_batch} is not a multiple of dp x micro-batch size = "
                                       f"{dp} x {size})")
    return replace(config, parallel=replace(par, dp=dp, microbatches=microbatches))


def with_dp_max(config: JobConfig, high: int) -> JobConfig:
    """An elastic job with its range's max lowered to `high` (what its owner's quota holds), the rest as it is."""
    limits = dp_range(config)
    if limits is None:
        raise PlanError("parallel.dp", "a fixed dp has no range to lower the max of")
    return replace(config, parallel=replace(fixed_parallel(config), dp=DpRange(min=limits[0], max=high)))


def reaching_max(config: JobConfig) -> JobConfig:
    """An elastic job with micro-batches that reach its `max`: a size dp keeps the micro-batch size (`resized`)
    only when dp x micro-batch size divides global_batch, so the micro-batch becomes the largest one, no larger
    than the one asked for (global_batch / (min x microbatches)), that both min and max keep (more micro-batches per
    rank at min; the same sequences per step). PlanError naming the sizes the job can reach when no micro-batch
    does (max does not divide global_batch). A fixed-size job, or one whose `max` is reached already, is returned
    as it is; a micro-batch that does not split at min is `resized`'s to name."""
    limits = None if config.parallel == "auto" else dp_range(config)
    if limits is None:
        return config
    (low, high), par, batch = limits, fixed_parallel(config), config.global_batch
    asked, rem = divmod(batch, low * par.microbatches)
    if rem or asked < 1 or low > high or batch % (high * asked) == 0:
        return config
    if batch % high:
        reachable = [dp for dp in range(low, high + 1) if batch % dp == 0]
        raise PlanError("parallel.dp", f"max={high} can never be reached: global_batch={batch} does not split into "
                                       f"{high} equal shares; of min={low} to max={high} the job can reach "
                                       f"{', '.join(map(str, reachable))} (global_batch a multiple of each): set max "
                                       f"to one of them, or global_batch to a multiple of {high}")
    both = batch // math.lcm(low, high)  # sequences per rank at the least common size: any divisor of it keeps both
    size = max(d for d in _divisors(both) if d <= asked)
    return replace(config, parallel=replace(par, microbatches=batch // (low * size)))


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


def resize_plan(plan: Plan, dp: int, cluster: ClusterResources | None = None) -> Plan:
    """`plan`'s job at `dp` replicas, keeping an elastic job's range: the one place a resize is planned (the
    service checks a request with it, the coordinator acts on it). PlanError naming the rule when the job cannot
    take that size: outside its range, a global batch that does not split, replicas that differ (local_sgd,
    diloco), or a layout the cluster cannot hold."""
    limits = plan.dp_range
    if (why := resize_refusal(sync := plan.parallel.sync)) is not None and dp != plan.dp:
        raise PlanError("parallel.sync", f"a {sync.kind} job is not resized: {why}")
    if limits is not None and not limits[0] <= dp <= limits[1]:
        raise PlanError("parallel.dp", f"dp={dp} is outside the job's range parallel.dp = {{min: {limits[0]}, "
                                       f"max: {limits[1]}}}")
    return replace(make_plan(resized(plan.config, dp), cluster), dp_range=limits)


def can_move_in_memory(old: Plan, new: Plan) -> bool:
    """Whether a resize can keep the state in the surviving ranks' memory: every rank of one (pp, tp) shard
    holds the same parameters and optimizer state (no ZeRO slices, no expert parallelism), and only dp
    changes. Otherwise the state moves through a checkpoint."""
    same = (old.pp, old.tp, old.vpp, old.placement, old.parallel.stage_layers) == (
        new.pp, new.tp, new.vpp, new.placement, new.parallel.stage_layers)
    return same and old.sharding.replicas_identical and old.ep == 1 and new.ep == 1


def make_plan(config: JobConfig, cluster: ClusterResources | None = None) -> Plan:
    """Validate `config` against every cross-field rule and lay the job out.

    With `cluster`, also refuse a job that could never be placed on it (resources needed vs available), or
    one of whose ranks would not fit the memory it gets (`parallel.plan.admission`). Every rule runs before
    anything that grows with the job's sizes is built (the plan itself is bounded by MAX_WORKERS and
    MAX_SCHEDULE_CHUNKS), so any spec is answered in milliseconds.
    """
    if config.parallel == "auto":
        raise PlanError("parallel", "parallel: auto is resolved by the planner (the service's submit, `trainyard "
                                    "plan --auto`) before a plan is made")
    limits = dp_range(config)
    if limits is not None:  # laid out at its smallest size, which is what must fit to start
        if limits[0] > limits[1]:
            raise PlanError("parallel.dp", f"min={limits[0]} is more than max={limits[1]}")
        if (why := resize_refusal(sync := fixed_parallel(config).sync)) is not None:
            raise PlanError("parallel.sync", f"{sync.kind} cannot run with an elastic parallel.dp: {why}")
        return replace(make_plan(resized(reaching_max(config), limits[0]), cluster), dp_range=limits)
    _raise_first(degree_violations(config))
    par = fixed_parallel(config)
    if cluster is not None:  # before the blocks are split: a job too large for the cluster is told that first
        degrees = Layout(dp=par.fixed_dp, pp=par.pp, tp=par.tp, cp=par.cp,
                         gpus_per_worker=_gpus_per_worker(config, cluster),
                         cpus_per_worker=config.resources.cpus_per_worker)
        _raise_first(fit_violations(degrees, cluster))
    layout = layout_of(config, cluster)
    if cluster is not None:
        _raise_first(memory_violations(layout, config, cluster))
    return Plan(config=config, layout=layout)


def _raise_first(errors: list[PlanError]) -> None:
    if errors:
        raise errors[0]


def layout_of(config: JobConfig, cluster: ClusterResources | None = None) -> Layout:
    """The layout of a fixed-size config that keeps every rule (`parallel.plan.rules.violations` is empty)."""
    par, moe = fixed_parallel(config), config.model.moe
    return Layout.build(
        dp=par.fixed_dp, pp=par.pp, tp=par.tp, ep=par.ep, cp=par.cp, vpp=par.vpp, microbatches=par.microbatches,
        micro_batch_size=config.global_batch // (par.fixed_dp * par.microbatches), layer_counts=layer_counts(config),
        schedule=par.schedule, experts=moe.experts if moe is not None else 0,
        gpus_per_worker=_gpus_per_worker(config, cluster), cpus_per_worker=config.resources.cpus_per_worker,
        replica_dp=layout_replica_dp(par.sync, par.fixed_dp),
    )


def layer_counts(config: JobConfig) -> list[int]:
    """Blocks per virtual stage: the explicit `stage_layers` list, or as even as possible."""
    _raise_first(stage_layer_violations(config))
    par = fixed_parallel(config)
    counts, n_stages = par.stage_layers, par.pp * par.vpp
    return list(counts) if counts is not None else even_layer_counts(config.model.n_layer, n_stages)


def split_layers(config: JobConfig) -> tuple[tuple[int, ...], ...]:
    """Global blocks of each virtual stage (raises PlanError naming the rule when they cannot be split)."""
    return stage_layers_of(layer_counts(config))


def _gpus_per_worker(config: JobConfig, cluster: ClusterResources | None) -> int:
    asked = config.resources.gpus_per_worker
    if asked == "auto":
        return 1 if cluster is not None and cluster.gpus > 0 else 0
    return asked
