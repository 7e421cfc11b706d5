"""The plan: one frozen object describing how a job is laid out, computed once from the JobConfig.

`make_plan(config, cluster)` checks every rule that relates several fields (each error names the field
and the rule, and the API returns it as a 422), then fixes the degrees, the rank grid, the process
groups, the layers of each pipeline stage and the resources each worker needs. Everything after it
receives the Plan and never re-derives layout. Pure: no I/O, no torch.

Rank order is tp fastest, then dp, then pp (Megatron's order): a tensor-parallel group is a run of
consecutive ranks, so it fits in one placement-group bundle and therefore on one node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from parallel.config import DpRange, JobConfig, RuleError
from parallel.memory import RankMemory, estimate
from parallel.models import family_of
from parallel.schedule_sim import Costs, render_gantt, simulate
from parallel.schedules import Action, ScheduleError, build_schedule, check_schedule_args, format_actions


class PlanError(RuleError):
    """A JobSpec whose fields do not fit together, or a job the cluster can never hold."""


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


@dataclass(frozen=True)
class RankCoords:
    rank: int
    pp: int
    tp: int
    dp: int


@dataclass(frozen=True)
class Plan:
    config: JobConfig
    dp: int
    pp: int
    tp: int
    ep: int
    vpp: int
    microbatches: int
    micro_batch_size: int
    """Sequences per micro-batch on one data-parallel rank."""
    ranks: tuple[RankCoords, ...]
    stage_layers: tuple[tuple[int, ...], ...]
    """Global block indices of each virtual stage v (rank v % pp holds chunk v // pp)."""
    schedule: tuple[tuple[Action, ...], ...]
    """The action list each pipeline rank runs every step (index = pp rank); see parallel.schedules."""
    gpus_per_worker: int
    cpus_per_worker: float
    dp_range: tuple[int, int] | None = None
    """An elastic job's (min, max) data-parallel size; `config` and `dp` are its current size."""

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def n_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, pp: int, tp: int, dp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> RankCoords:
        return self.ranks[rank]

    def dp_groups(self) -> list[list[int]]:
        """Ranks that hold the same parameters and average gradients."""
        return [[self.rank_of(p, t, d) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks that form one pipeline, in stage order."""
        return [[self.rank_of(p, t, d) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, t, d) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def ep_rank(self, rank: int) -> int:
        """A rank's place in its expert-parallel group: ep groups are runs of `ep` consecutive dp ranks."""
        return self.coords(rank).dp % self.ep

    def ep_groups(self) -> list[list[int]]:
        """Ranks that exchange tokens: same pp and tp, dp ranks g*ep .. g*ep + ep - 1."""
        return [[self.rank_of(p, t, g * self.ep + j) for j in range(self.ep)]
                for p in range(self.pp) for t in range(self.tp) for g in range(self.dp // self.ep)]

    def expert_groups(self) -> list[list[int]]:
        """Ranks that hold the same experts and sum their gradients: one stage, one ep index, every tp rank
        (each computed its own slice of the tokens) and every dp replica."""
        return [[self.rank_of(p, t, d) for d in range(j, self.dp, self.ep) for t in range(self.tp)]
                for p in range(self.pp) for j in range(self.ep)]

    def stage_groups(self) -> list[list[int]]:
        """Every rank of one pipeline stage: they sum the router's gradients and the MoE statistics."""
        return [[self.rank_of(p, t, d) for d in range(self.dp) for t in range(self.tp)] for p in range(self.pp)]

    def experts_of(self, rank: int) -> range:
        """Global indices of the experts a rank hosts in each of its MoE blocks (empty for a dense model)."""
        moe = self.config.model.moe
        if moe is None:
            return range(0)
        per_rank = moe.experts // self.ep
        start = self.ep_rank(rank) * per_rank
        return range(start, start + per_rank)

    def chunk_layers(self, pp_rank: int) -> list[tuple[int, ...]]:
        """The blocks of each chunk a pipeline rank holds, chunk 0 first."""
        return [self.stage_layers[c * self.pp + pp_rank] for c in range(self.vpp)]

    def bundle_of(self, rank: int) -> int:
        """The placement-group bundle a rank is placed in: its tensor-parallel group's, so the ranks of one
        tp group always share a node."""
        return rank // self.tp

    def worker_name(self, rank: int) -> str:
        """`pp0-tp1-dp2`, and with expert parallelism the experts it hosts: `pp0-tp1-dp2-experts4-7`."""
        c = self.coords(rank)
        name = f"pp{c.pp}-tp{c.tp}-dp{c.dp}"
        if self.ep > 1:
            experts = self.experts_of(rank)
            name += f"-experts{experts[0]}-{experts[-1]}"
        return name

    @property
    def gang(self) -> Gang:
        return Gang.of(self.cpus_per_worker, self.gpus_per_worker, tp=self.tp, groups=self.dp * self.pp)

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per tensor-parallel group (a bundle always lands on one node)."""
        return self.gang.bundles()

    def resources_needed(self) -> dict[str, float]:
        return self.gang.needed()


@dataclass(frozen=True)
class Gang:
    """What a job needs from the cluster, all at once: `count` identical bundles (one per tp group)."""

    bundle: dict[str, float]
    count: int

    @staticmethod
    def of(cpus_per_worker: float, gpus_per_worker: int, *, tp: int, groups: int) -> Gang:
        bundle = {"CPU": cpus_per_worker * tp}
        if gpus_per_worker:
            bundle["GPU"] = float(gpus_per_worker * tp)
        return Gang(bundle=bundle, count=groups)

    def bundles(self) -> list[dict[str, float]]:
        return [dict(self.bundle) for _ in range(self.count)]

    def needed(self) -> dict[str, float]:
        return {"CPU": self.bundle["CPU"] * self.count, "GPU": self.bundle.get("GPU", 0.0) * self.count}

    def placeable(self, nodes: list[dict[str, float]]) -> int:
        """How many of the bundles fit on nodes with these free (or total) resources; Ray's PACK strategy
        packs whole bundles onto nodes, so this is the sum over nodes of the copies each can hold."""
        return sum(min(math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in self.bundle.items() if v > 0)
                   for node in nodes)


MAX_WORKERS = 2**16
MAX_SCHEDULE_CHUNKS = 2**13
"""pp x vpp x microbatches: the size of the action lists the plan builds and simulates (about 0.1 ms of
planning each). Above real jobs (pp=16, vpp=2, m=256 is at the bound)."""


def dp_range(config: JobConfig) -> tuple[int, int] | None:
    """(min, max) of an elastic job, None for a fixed size."""
    dp = config.parallel.dp
    return (dp.min, dp.max) if isinstance(dp, DpRange) else None


def resized(config: JobConfig, dp: int) -> JobConfig:
    """The job at `dp` data-parallel replicas: the same global batch in micro-batches of the same size, so
    only the micro-batches per rank change (and the loss curve does not). Raises PlanError naming the rule
    when the global batch cannot be split that way, or `dp` is outside an elastic job's range; `make_plan`
    checks the rest. The result has a fixed dp (an elastic plan keeps its range in `Plan.dp_range`)."""
    par, limits = config.parallel, dp_range(config)
    if limits is not None and not limits[0] <= dp <= limits[1]:
        raise PlanError("parallel.dp", f"dp={dp} is outside the job's range parallel.dp = {{min: {limits[0]}, "
                              f"max: {limits[1]}}}")
    size = config.global_batch // ((par.dp if limits is None else limits[0]) * par.microbatches)
    microbatches, rem = divmod(config.global_batch, dp * size) if size else (0, 1)
    if dp < 1 or rem or microbatches < 1:
        raise PlanError("parallel.dp", f"dp={dp}: global_batch={config.global_batch} in micro-batches of {size} "
                                       f"sequences cannot be split evenly over {dp} data-parallel ranks "
                                       f"({config.global_batch} is not a multiple of dp x micro-batch size = "
                                       f"{dp} x {size})")
    return replace(config, parallel=replace(par, dp=dp, microbatches=microbatches))


def can_move_in_memory(old: Plan, new: Plan) -> bool:
    """Whether a resize can keep the state in the surviving ranks' memory: every rank of one (pp, tp) shard
    holds the same parameters and optimizer state (no ZeRO slices, no expert parallelism), and only dp
    changes. Otherwise the state moves through a checkpoint."""
    same = (old.pp, old.tp, old.vpp, old.config.parallel.stage_layers) == (new.pp, new.tp, new.vpp,
                                                                            new.config.parallel.stage_layers)
    return same and old.config.parallel.zero == 0 and old.ep == 1 and new.ep == 1


def make_plan(config: JobConfig, cluster: ClusterResources | None = None) -> Plan:
    """Validate `config` against every cross-field rule and lay the job out.

    With `cluster`, also refuse a job that could never be placed on it (resources needed vs available), or
    one of whose ranks would not fit the memory it gets (`check_memory`). Every rule runs before anything
    that grows with the job's sizes is built (the plan itself is bounded by MAX_WORKERS and
    MAX_SCHEDULE_CHUNKS), so any spec is answered in milliseconds.
    """
    limits = dp_range(config)
    if limits is not None:  # laid out at its smallest size, which is what must fit to start
        if limits[0] > limits[1]:
            raise PlanError("parallel.dp", f"min={limits[0]} is more than max={limits[1]}")
        return replace(make_plan(resized(config, limits[0]), cluster), dp_range=limits)
    _check_model(config)
    _check_experts(config)
    _check_tensor_parallel(config)
    par = config.parallel
    _check_sizes(config)
    per_rank, rem = divmod(config.global_batch, par.dp * par.microbatches)
    if rem:
        raise PlanError(
            "global_batch",
            f"global_batch={config.global_batch} is not divisible by dp x microbatches = "
            f"{par.dp} x {par.microbatches} = {par.dp * par.microbatches}",
        )
    _check_schedule(config)
    gpus = _gpus_per_worker(config, cluster)
    if cluster is not None:
        gang = Gang.of(config.resources.cpus_per_worker, gpus, tp=par.tp, groups=par.dp * par.pp)
        check_fits(config, gang, cluster)
    plan = Plan(
        config=config,
        dp=par.dp,
        pp=par.pp,
        tp=par.tp,
        ep=par.ep,
        vpp=par.vpp,
        microbatches=par.microbatches,
        micro_batch_size=per_rank,
        ranks=_rank_grid(par.pp, par.tp, par.dp),
        stage_layers=split_layers(config),
        schedule=tuple(map(tuple, build_schedule(par.schedule, par.pp, par.microbatches, par.vpp))),
        gpus_per_worker=gpus,
        cpus_per_worker=config.resources.cpus_per_worker,
    )
    if cluster is not None:
        check_memory(plan, cluster)
    return plan


def _check_sizes(config: JobConfig) -> None:
    """Bounds on what the plan would build: the rank grid and the schedule's action lists."""
    par = config.parallel
    workers = par.dp * par.pp * par.tp
    if workers > MAX_WORKERS:
        raise PlanError("parallel.dp", f"dp x pp x tp = {par.dp} x {par.pp} x {par.tp} = {workers} workers; "
                                       f"at most {MAX_WORKERS}")
    chunks = par.pp * par.vpp * par.microbatches
    if chunks > MAX_SCHEDULE_CHUNKS:
        raise PlanError("parallel.microbatches",
                        f"pp x vpp x microbatches = {par.pp} x {par.vpp} x {par.microbatches} = {chunks} "
                        f"chunk forwards per step; at most {MAX_SCHEDULE_CHUNKS}")


def _check_model(config: JobConfig) -> None:
    m = config.model
    if m.d_model % m.n_head:
        raise PlanError("model.n_head", f"n_head={m.n_head} does not divide d_model={m.d_model}")
    if m.seq_len > m.context:
        raise PlanError("model.seq_len", f"seq_len={m.seq_len} exceeds the model context context_len={m.context}")
    if config.data.kind == "text" and m.vocab_size < 256:
        raise PlanError("model.vocab_size", f"data.kind=text uses byte tokens and needs vocab_size >= 256 "
                                            f"(got {m.vocab_size})")
    if config.data.kind in ("text", "tokens") and not config.data.path and not config.data.sources:
        raise PlanError("data.path", f"data.kind={config.data.kind} needs a path (or, for tokens, sources)")
    if m.tie_embeddings and config.parallel.pp > 1:
        raise PlanError("model.tie_embeddings", "tied embeddings need pp=1 (the embedding and the head "
                                                "live on different pipeline stages)")
    for error in family_of(m).check(config):  # the family's own rules (parallel.models)
        raise PlanError(error.field, error.message)


def _check_experts(config: JobConfig) -> None:
    moe, ep, dp = config.model.moe, config.parallel.ep, config.parallel.dp
    if moe is None:
        if ep > 1:
            raise PlanError("parallel.ep", f"ep={ep} needs mixture-of-experts layers (model.moe)")
        return
    if moe.top_k > moe.experts:
        raise PlanError("model.moe.top_k", f"top_k={moe.top_k} exceeds experts={moe.experts} (a token is routed to "
                                           "top_k different experts)")
    if moe.every > config.model.n_layer:
        raise PlanError("model.moe.every", f"every={moe.every} exceeds n_layer={config.model.n_layer}: no block "
                                           "would be a mixture-of-experts block")
    if dp % ep:
        raise PlanError("parallel.ep", f"ep={ep} does not divide dp={dp} (expert-parallel groups are carved out of "
                                       "the data-parallel ranks)")
    if moe.experts % ep:
        raise PlanError("parallel.ep", f"ep={ep} does not divide experts={moe.experts} (each expert-parallel rank "
                                       "hosts experts / ep experts)")
    tp = config.parallel.tp
    if tp > 1 and config.model.seq_len % tp:
        raise PlanError("parallel.tp", f"tp={tp} does not divide seq_len={config.model.seq_len} (each "
                                       "tensor-parallel rank routes one slice of every sequence to the experts)")


def _check_tensor_parallel(config: JobConfig) -> None:
    """tp splits heads, the vocabulary (embedding and head) and, with sp, the sequence: each must divide evenly."""
    m, tp, sp = config.model, config.parallel.tp, config.parallel.sp
    if m.n_head % tp:
        raise PlanError("parallel.tp", f"tp={tp} does not divide n_head={m.n_head} (attention heads are split "
                                       "across tensor-parallel ranks)")
    if m.vocab_size % tp:
        raise PlanError("parallel.tp", f"tp={tp} does not divide vocab_size={m.vocab_size} (the embedding and the "
                                       "output head are split over the vocabulary)")
    if sp and tp == 1:
        raise PlanError("parallel.sp", "sp=true needs tp > 1 (sequence parallelism shards over the tensor-parallel "
                                       "ranks)")
    if sp and m.seq_len % tp:
        raise PlanError("parallel.sp", f"sp=true splits the sequence over tp: tp={tp} does not divide "
                                       f"seq_len={m.seq_len}")


def _check_schedule(config: JobConfig) -> None:
    par = config.parallel
    try:
        check_schedule_args(par.schedule, par.pp, par.microbatches, par.vpp)
    except ScheduleError as e:
        raise PlanError("parallel.schedule", str(e)) from None


def split_layers(config: JobConfig) -> tuple[tuple[int, ...], ...]:
    """Blocks of each virtual stage: the explicit `stage_layers` list, or as even as possible."""
    n_layer, n_stages = config.model.n_layer, config.parallel.pp * config.parallel.vpp
    counts = config.parallel.stage_layers
    if counts is None:
        if n_layer < n_stages:
            raise PlanError("parallel.pp", f"n_layer={n_layer} cannot be split into pp x vpp = {n_stages} "
                                           "stages of at least one block each")
        base, extra = divmod(n_layer, n_stages)
        # Middle stages take the extra blocks first: the first stage also embeds and the last runs the head
        # and loss (the heavier of the two, so it is the last to get one).
        preferred = [*range(1, n_stages - 1), 0, n_stages - 1][:extra]
        counts = [base + (v in preferred) for v in range(n_stages)]
    elif len(counts) != n_stages:
        raise PlanError("parallel.stage_layers", f"has {len(counts)} entries but pp x vpp = {n_stages} stages")
    elif sum(counts) != n_layer:
        raise PlanError("parallel.stage_layers", f"sums to {sum(counts)} but n_layer={n_layer}")
    starts = [sum(counts[:v]) for v in range(n_stages)]
    return tuple(tuple(range(s, s + c)) for s, c in zip(starts, counts, strict=True))


def _rank_grid(pp: int, tp: int, dp: int) -> tuple[RankCoords, ...]:
    grid = [RankCoords(rank=(p * dp + d) * tp + t, pp=p, tp=t, dp=d)
            for p in range(pp) for d in range(dp) for t in range(tp)]
    return tuple(sorted(grid, key=lambda c: c.rank))


def _gpus_per_worker(config: JobConfig, cluster: ClusterResources | None) -> int:
    asked = config.resources.gpus_per_worker
    if asked == "auto":
        return 1 if cluster is not None and cluster.gpus > 0 else 0
    return asked


def check_fits(config: JobConfig, gang: Gang, cluster: ClusterResources) -> None:
    """Refuse a job whose bundles could never all be placed, even on an idle cluster."""
    placeable = gang.placeable([{"CPU": n.cpus, "GPU": n.gpus} for n in cluster.nodes])
    if placeable >= gang.count:
        return
    par = config.parallel
    need = gang.needed()
    need_txt = f"{need['CPU']:g} CPU" + (f", {need['GPU']:g} GPU" if need["GPU"] else "")
    have_txt = f"{cluster.cpus:g} CPU, {cluster.gpus:g} GPU on {len(cluster.nodes)} node(s)"
    workers = par.dp * par.pp * par.tp
    raise PlanError(
        "parallel.dp",
        f"the job needs {workers} workers ({need_txt}; dp={par.dp} x pp={par.pp} x tp={par.tp}) "
        f"but the cluster can ever hold only {placeable * par.tp} (it has {have_txt})",
    )


def check_memory(plan: Plan, cluster: ClusterResources) -> None:
    """Refuse a job one of whose ranks cannot fit the memory it would get, by the plan's estimate
    (`parallel.memory`: parameters, gradients, optimizer state and peak activations).

    A rank with GPUs keeps all of it in its GPU: it must fit one GPU (the largest the cluster has; skipped when
    no node's GPU memory is known). A CPU rank shares its node's memory (Ray's `memory` resource) with the job's
    other ranks there, and Ray packs a job's bundles onto as few nodes as it can: a node holding k of the job's
    tp groups (as many as its CPUs and GPUs allow) gives each of its k x tp ranks 1/(k x tp) of its memory. The
    largest rank must fit the best such share any node offers.
    """
    ranks = estimate(plan)
    worst = max(range(plan.world_size), key=lambda r: ranks[r].total)
    need = ranks[worst]
    if plan.gpus_per_worker:
        have = max((n.gpu_memory for n in cluster.nodes if n.gpus > 0), default=0.0)
        where = f"a GPU has {_gib(have)}"
    else:
        gang = plan.gang
        shares = [(n.memory / (plan.tp * held), n.memory, plan.tp * held) for n in cluster.nodes
                  if n.memory > 0 and (held := min(gang.count, gang.placeable([{"CPU": n.cpus, "GPU": n.gpus}])))]
        have, node_memory, sharing = max(shares, default=(0.0, 0.0, 0))
        where = (f"a rank gets at most {_gib(have)} of a node's memory (Ray's `memory` resource: {_gib(node_memory)} "
                 f"on a node that would hold {sharing} of the job's ranks)")
    if have <= 0 or need.total <= have:
        return
    div, unit = _unit(need.total)
    parts = ", ".join(f"{name} {getattr(need, name) / div:,.1f}" for name in _MEMORY_PARTS
                      if getattr(need, name) >= div / 20)  # the parts that show
    state = need.params + need.grads + need.optimizer
    field = "model" if state >= need.activations + need.recompute else "global_batch"
    raise PlanError(field, f"rank {worst} ({plan.worker_name(worst)}) needs {need.total / div:,.1f} {unit} "
                           f"({parts}) but {where}; {_memory_advice(plan, need)}")


_MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "recompute")


def _memory_advice(plan: Plan, need: RankMemory) -> str:
    """What would shrink the largest part of the rank's memory. On GPUs each rank has its own memory, so
    spreading the model over more ranks helps; CPU ranks share their node's, so only holding less does."""
    cfg, options = plan.config, []
    if need.params + need.grads + need.optimizer >= need.activations + need.recompute:
        options.append("raise pp or tp" if plan.gpus_per_worker else "use a node with more memory")
        if plan.dp > 1 and cfg.parallel.zero == 0:
            options.append("set parallel.zero: 1")
        if plan.dp > 1 and not plan.gpus_per_worker:
            options.append("lower dp (each replica holds the whole model state)")
    else:
        more = "dp or microbatches" if plan.gpus_per_worker else "microbatches"
        options.append(f"lower global_batch or raise {more} (smaller micro-batches)")
        if cfg.activation_checkpointing != "full":
            options.append("set activation_checkpointing: full")
    return "; ".join(options)


def _gib(nbytes: float) -> str:
    div, unit = _unit(nbytes)
    return f"{nbytes / div:,.3g} {unit}" if nbytes < 1000 * div else f"{nbytes / div:,.0f} {unit}"


def _unit(nbytes: float) -> tuple[int, str]:
    """The binary unit a byte count reads best in (GiB from 1 GiB up, MiB below, KiB under a MiB)."""
    for div, unit in ((2**30, "GiB"), (2**20, "MiB")):
        if nbytes >= div:
            return div, unit
    return 2**10, "KiB"


def describe(plan: Plan) -> dict:
    """The plan as plain data for the API and the CLI: degrees, rank map, groups, stages, schedule, resources."""
    return {
        "world_size": plan.world_size,
        "degrees": {"dp": plan.dp, "pp": plan.pp, "tp": plan.tp, "ep": plan.ep, "vpp": plan.vpp},
        "microbatches": plan.microbatches,
        "micro_batch_size": plan.micro_batch_size,
        "ranks": [{"rank": c.rank, "pp": c.pp, "tp": c.tp, "dp": c.dp, "ep": plan.ep_rank(c.rank),
                   "name": plan.worker_name(c.rank), "bundle": plan.bundle_of(c.rank),
                   "experts": list(plan.experts_of(c.rank))} for c in plan.ranks],
        "groups": {"dp": plan.dp_groups(), "pp": plan.pp_groups(), "tp": plan.tp_groups(), "ep": plan.ep_groups(),
                   "experts": plan.expert_groups() if plan.config.model.moe else []},
        "moe_blocks": plan.config.model.moe_blocks,
        "stage_layers": [list(layers) for layers in plan.stage_layers],
        "schedule": describe_schedule(plan),
        "memory": describe_memory(plan),
        "resources": {
            "per_worker": {"CPU": plan.cpus_per_worker, "GPU": plan.gpus_per_worker},
            "bundles": plan.bundles(),
            "needed": plan.resources_needed(),
        },
    }


def describe_memory(plan: Plan) -> dict:
    """The memory plan (`parallel.memory`), in bytes: each rank's parameters, gradients, optimizer state, peak
    activations and recompute transient, their total, and the rank with the largest total."""
    ranks = estimate(plan)
    stages = {id(m): m.to_dict() for m in ranks}  # one RankMemory per stage, shared by its ranks
    per_rank = [{"rank": r, **stages[id(m)]} for r, m in enumerate(ranks)]
    return {"per_rank": per_rank, "largest": max(per_rank, key=lambda m: m["total"])}


def describe_schedule(plan: Plan) -> dict:
    """The step's schedule, simulated with the spec's `sim_costs` before anything runs.

    `stages` holds each pipeline rank's actions in order (communication runs bracketed, see
    `parallel.schedules.format_actions`); `peak_activations` counts chunk activations per pipeline rank.
    """
    c = plan.config.sim_costs
    result = simulate([list(actions) for actions in plan.schedule], plan.microbatches, plan.vpp,
                      Costs(forward=c.forward, backward=c.backward, comm=c.comm))
    return {
        "kind": plan.config.parallel.schedule,
        "pp": plan.pp,
        "vpp": plan.vpp,
        "microbatches": plan.microbatches,
        "costs": {"forward": c.forward, "backward": c.backward, "comm": c.comm},
        "stages": [format_actions(list(actions)) for actions in plan.schedule],
        "makespan": result.makespan,
        "bubble_fraction": result.bubble_fraction,
        "peak_activations": result.peak_activations,
        "gantt": render_gantt(result),
    }
