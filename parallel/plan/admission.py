"""Admission: whether a cluster could ever hold a laid-out job, by its resources and by its memory.

`fit_violations(layout, cluster)` refuses a gang of bundles that could never all be placed, even on an idle cluster;
`memory_violations(layout, config, cluster)` refuses a job one of whose ranks cannot fit the memory it would get, by the
memory plan's estimate (`parallel.plan.memory.estimate`). Both return their violations (`PlanError`s naming the field to
change) instead of raising, and work from a `Layout`, so a planner can ask "does this fit" of any candidate without
building a Plan. Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.parallel.config import JobConfig
from trainyard.parallel.plan.layout import Layout
from trainyard.parallel.plan.memory.estimate import RankMemory, estimate
from trainyard.parallel.plan.rules import PlanError
from trainyard.parallel.plan.sharding import SHARDINGS
from trainyard.parallel.plan.sizing import fixed_parallel
from trainyard.parallel.plan.units import byte_unit, format_size


@dataclass(frozen=True)
class NodeResources:
    cpus: float
    gpus: float
    memory: float = 0.0
    """Bytes of memory Ray may hand to tasks and actors on the node (0: unknown)."""
    gpu_memory: float = 0.0
    """Bytes of memory of each of the node's GPUs (0: unknown). Ray does not report it: the service reads it
    off the node's `accelerator_type` (see `service.ray_runtime`)."""


@dataclass(frozen=True)
class ClusterResources:
    """What the Ray cluster holds in total, node by node (not what is free right now)."""

    nodes: tuple[NodeResources, ...]

    @property
    def cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)

    @property
    def gpus(self) -> float:
        return sum(n.gpus for n in self.nodes)


def fit_violations(layout: Layout, cluster: ClusterResources) -> list[PlanError]:
    """A job whose bundles could never all be placed, even on an idle cluster."""
    gang = layout.gang
    placeable = gang.placeable([{"CPU": n.cpus, "GPU": n.gpus} for n in cluster.nodes])
    if placeable >= gang.count:
        return []
    need = gang.needed()
    need_txt = f"{need['CPU']:g} CPU" + (f", {need['GPU']:g} GPU" if need["GPU"] else "")
    have_txt = f"{cluster.cpus:g} CPU, {cluster.gpus:g} GPU on {len(cluster.nodes)} node(s)"
    return [PlanError(
        "parallel.dp",
        f"the job needs {layout.world_size} workers ({need_txt}; dp={layout.dp} x pp={layout.pp} x tp={layout.tp}) "
        f"but the cluster can ever hold only {placeable * layout.tp} (it has {have_txt})",
    )]


def memory_violations(layout: Layout, config: JobConfig, cluster: ClusterResources) -> list[PlanError]:
    """A job one of whose ranks cannot fit the memory it would get, by the memory plan's estimate
    (`parallel.plan.memory.estimate`: parameters, gradients, optimizer state and peak activations).

    A rank with GPUs keeps all of it in its GPU: it must fit one GPU (the largest the cluster has; skipped when
    no node's GPU memory is known). A CPU rank shares its node's memory (Ray's `memory` resource) with the job's
    other ranks there, and Ray packs a job's bundles onto as few nodes as it can: a node holding k of the job's
    tp groups (as many as its CPUs and GPUs allow) gives each of its k x tp ranks 1/(k x tp) of its memory. The
    largest rank must fit the best such share any node offers. So must a GPU rank's host bytes (`optimizer.offload`
    and `activation_offload` keep their state there; construction draws each parameter whole there).
    """
    ranks = estimate(layout, config)
    on_gpu = bool(layout.gpus_per_worker)
    worst = max(range(layout.world_size), key=lambda r: ranks[r].resident(on_gpu))
    need = ranks[worst]
    gang = layout.gang
    shares = [(n.memory / (layout.tp * held), n.memory, layout.tp * held) for n in cluster.nodes
              if n.memory > 0 and (held := min(gang.count, gang.placeable([{"CPU": n.cpus, "GPU": n.gpus}])))]
    share, node_memory, sharing = max(shares, default=(0.0, 0.0, 0))
    host_where = (f"a rank gets at most {format_size(share)} of a node's memory (Ray's `memory` resource: "
                  f"{format_size(node_memory)} on a node that would hold {sharing} of the job's ranks)")
    if on_gpu:
        have = max((n.gpu_memory for n in cluster.nodes if n.gpus > 0), default=0.0)
        where = f"a GPU has {format_size(have)}"
    else:
        have, where = share, host_where
    total = need.resident(on_gpu)
    if have <= 0 or total <= have:
        return _host_violations(layout, ranks, share, host_where) if on_gpu else []
    div, unit = byte_unit(total)
    names = _MEMORY_PARTS if on_gpu else (*_MEMORY_PARTS, "host_optimizer", "host_activations")
    parts = ", ".join(f"{name} {getattr(need, name) / div:,.1f}" for name in names
                      if getattr(need, name) >= div / 20)  # the parts that show
    state = need.params + need.grads + need.optimizer
    field = "model" if state >= need.activations + need.transient else "global_batch"
    return [PlanError(field, f"rank {worst} ({layout.worker_name(worst)}) needs {total / div:,.1f} {unit} "
                             f"({parts}) but {where}; {_memory_advice(layout, config, need)}")]


_MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "transient")


def _host_violations(layout: Layout, ranks: list[RankMemory], share: float, where: str) -> list[PlanError]:
    """A GPU rank whose host bytes (offload's state, construction's whole parameter) exceed its share of a node's
    memory (none when the share is unknown)."""
    worst = max(range(layout.world_size), key=lambda r: ranks[r].host_resident)
    need = ranks[worst]
    if share <= 0 or need.host_resident <= share:
        return []
    div, unit = byte_unit(need.host_resident)
    parts = ", ".join(f"{name} {getattr(need, name) / div:,.1f}" for name in ("host_optimizer", "host_activations",
                                                                             "construction")
                      if getattr(need, name) >= div / 20)
    field = "optimizer.offload" if need.host_optimizer >= need.host_activations else "activation_offload"
    return [PlanError(field, f"rank {worst} ({layout.worker_name(worst)}) needs {need.host_resident / div:,.1f} "
                             f"{unit} of host memory ({parts}) but {where}; raise pp or tp (each rank then holds "
                             "less), or use nodes with more memory")]


def _memory_advice(layout: Layout, config: JobConfig, need: RankMemory) -> str:
    """What would shrink the largest part of the rank's memory. On GPUs each rank has its own memory, so
    spreading the model over more ranks helps; CPU ranks share their node's, so only holding less does."""
    options = []
    if need.params + need.grads + need.optimizer >= need.activations + need.transient:
        options.append("raise pp or tp" if layout.gpus_per_worker else "use a node with more memory")
        sharding_more = [z for z in SHARDINGS if z > fixed_parallel(config).zero]
        if layout.dp > 1 and sharding_more:
            options.append(f"set parallel.zero: {' or '.join(map(str, sharding_more))}")
        if layout.dp > 1 and not layout.gpus_per_worker:
            options.append("lower dp (each replica holds the whole model state)")
    else:
        more = "dp or microbatches" if layout.gpus_per_worker else "microbatches"
        options.append(f"lower global_batch or raise {more} (smaller micro-batches)")
        if config.activation_checkpointing != "full":
            options.append("set activation_checkpointing: full")
    return "; ".join(options)
