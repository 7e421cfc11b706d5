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
from dataclasses import dataclass

from parallel.config import JobConfig, RuleError
from parallel.schedule_sim import Costs, render_gantt, simulate
from parallel.schedules import Action, ScheduleError, build_schedule, check_schedule_args, format_actions


class PlanError(RuleError):
    """A JobSpec whose fields do not fit together, or a job the cluster can never hold."""


@dataclass(frozen=True)
class NodeResources:
    cpus: float
    gpus: float


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

    def chunk_layers(self, pp_rank: int) -> list[tuple[int, ...]]:
        """The blocks of each chunk a pipeline rank holds, chunk 0 first."""
        return [self.stage_layers[c * self.pp + pp_rank] for c in range(self.vpp)]

    def worker_name(self, rank: int) -> str:
        c = self.coords(rank)
        return f"pp{c.pp}-tp{c.tp}-dp{c.dp}"

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per tensor-parallel group (a bundle always lands on one node)."""
        bundle = {"CPU": self.cpus_per_worker * self.tp}
        if self.gpus_per_worker:
            bundle["GPU"] = float(self.gpus_per_worker * self.tp)
        return [dict(bundle) for _ in self.tp_groups()]

    def resources_needed(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_worker * self.world_size, "GPU": float(self.gpus_per_worker * self.world_size)}


# Capabilities later issues add. Each entry: (field, predicate on the config, what is missing).
_NOT_YET = (
    ("parallel.ep", lambda c: c.parallel.ep > 1, "expert parallelism (ep > 1)"),
    ("model.moe", lambda c: c.model.moe is not None, "mixture-of-experts layers"),
    ("precision", lambda c: c.precision != "fp32", "bf16 training"),
    ("checkpoint.every", lambda c: c.checkpoint.every > 0, "checkpointing"),
    ("fault.max_failures", lambda c: c.fault.max_failures > 0, "restarting after a failure"),
)


def make_plan(config: JobConfig, cluster: ClusterResources | None = None) -> Plan:
    """Validate `config` against every cross-field rule and lay the job out.

    With `cluster`, also refuse a job that could never be placed on it (resources needed vs available).
    """
    for field, unsupported, what in _NOT_YET:
        if unsupported(config):
            raise PlanError(field, f"{what} is not supported yet")
    _check_model(config)
    _check_tensor_parallel(config)
    par = config.parallel
    per_rank, rem = divmod(config.global_batch, par.dp * par.microbatches)
    if rem:
        raise PlanError(
            "global_batch",
            f"global_batch={config.global_batch} is not divisible by dp x microbatches = "
            f"{par.dp} x {par.microbatches} = {par.dp * par.microbatches}",
        )
    _check_schedule(config)
    gpus = _gpus_per_worker(config, cluster)
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
        check_fits(plan, cluster)
    return plan


def _check_model(config: JobConfig) -> None:
    m = config.model
    if m.d_model % m.n_head:
        raise PlanError("model.n_head", f"n_head={m.n_head} does not divide d_model={m.d_model}")
    if m.seq_len > m.context:
        raise PlanError("model.seq_len", f"seq_len={m.seq_len} exceeds the model context context_len={m.context}")
    if config.data.kind == "text" and m.vocab_size < 256:
        raise PlanError("model.vocab_size", f"data.kind=text uses byte tokens and needs vocab_size >= 256 "
                                            f"(got {m.vocab_size})")
    if config.data.kind in ("text", "tokens") and not config.data.path:
        raise PlanError("data.path", f"data.kind={config.data.kind} needs a path")
    if m.tie_embeddings and config.parallel.pp > 1:
        raise PlanError("model.tie_embeddings", "tied embeddings need pp=1 (the embedding and the head "
                                                "live on different pipeline stages)")


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


def check_fits(plan: Plan, cluster: ClusterResources) -> None:
    """Refuse a job whose bundles could never all be placed, even on an idle cluster."""
    bundle = plan.bundles()[0]
    n_bundles = len(plan.bundles())
    placeable = sum(_copies_that_fit(bundle, node) for node in cluster.nodes)
    if placeable >= n_bundles:
        return
    need = plan.resources_needed()
    need_txt = f"{need['CPU']:g} CPU" + (f", {need['GPU']:g} GPU" if need["GPU"] else "")
    have_txt = f"{cluster.cpus:g} CPU, {cluster.gpus:g} GPU on {len(cluster.nodes)} node(s)"
    raise PlanError(
        "parallel.dp",
        f"the job needs {plan.world_size} workers ({need_txt}; dp={plan.dp} x pp={plan.pp} x tp={plan.tp}) "
        f"but the cluster can ever hold only {placeable} (it has {have_txt})",
    )


def _copies_that_fit(bundle: dict[str, float], node: NodeResources) -> int:
    have = {"CPU": node.cpus, "GPU": node.gpus}
    return min(math.floor(have[k] / v + 1e-9) for k, v in bundle.items() if v > 0)


def describe(plan: Plan) -> dict:
    """The plan as plain data for the API and the CLI: degrees, rank map, groups, stages, schedule, resources."""
    return {
        "world_size": plan.world_size,
        "degrees": {"dp": plan.dp, "pp": plan.pp, "tp": plan.tp, "ep": plan.ep, "vpp": plan.vpp},
        "microbatches": plan.microbatches,
        "micro_batch_size": plan.micro_batch_size,
        "ranks": [{"rank": c.rank, "pp": c.pp, "tp": c.tp, "dp": c.dp, "name": plan.worker_name(c.rank)}
                  for c in plan.ranks],
        "groups": {"dp": plan.dp_groups(), "pp": plan.pp_groups(), "tp": plan.tp_groups()},
        "stage_layers": [list(layers) for layers in plan.stage_layers],
        "schedule": describe_schedule(plan),
        "resources": {
            "per_worker": {"CPU": plan.cpus_per_worker, "GPU": plan.gpus_per_worker},
            "bundles": plan.bundles(),
            "needed": plan.resources_needed(),
        },
    }


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
