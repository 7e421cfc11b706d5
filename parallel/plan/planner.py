"""The automatic layout planner (`parallel: auto`): the valid layouts of a job on a cluster, ranked by
predicted step time.

`plan_layouts(config, cluster, machine)` enumerates degree tuples (dp, pp, tp, ep, sp), micro-batch counts,
schedules with their vpp (`parallel.plan.schedules.SCHEDULES`) and, for each, the searched options (`SEARCHED`:
the values of `parallel.zero` in `parallel.plan.sharding.SHARDINGS`, the `activation_checkpointing` modes read off
the config's Literal, and any offload switch the config has), so a new registry entry joins the search with
no change here. Options that change the training's numbers (the optimizer kind, gradient compression, the
reduce dtype, local SGD) stay as the user wrote them.

Best first: each (degrees, micro-batches, schedule, vpp) gets a cheap lower bound on its step time (FLOPs /
throughput and the measured fixed costs, slowed by the ranks sharing a node, plus the pipeline's fill and the
cheapest sharding level's optimizer step and gathers). They are taken from one queue in bound order; a base
taken puts its variants (the searched options) in the queue by the lower bound of their costs (the rules,
`parallel.plan.rules.violations`, and `parallel.plan.cost_model.step_costs`, no memory plan, no simulation), a variant
with a saver on (recompute, offload: they only add time) at first by its saver-free sibling's bound. Only a
variant taken from the queue is sized (`parallel.plan.memory`, with `margin` kept free) and simulated (cached per
schedule, pp, vpp, micro-batches and cost ratios; the planner's own schedules, checked by their tests, are not
checked again), until nothing left can beat the `top`-th best time found. The predicted step time is the
simulated makespan with the cost model's per-chunk costs (`parallel.plan.cost_model`) plus the terms outside the
pipeline. Pure: no torch.

Left out of the search, by hand: uneven stages (pp and pp x vpp must
divide n_layer), pipelines with fewer micro-batches than stages, more than MAX_VPP chunks per rank or
MAX_SEARCH_CHUNKS chunk forwards per step; elastic dp ranges. The memory check reads the first, middle and
last stage (the winner is then checked on every rank by `parallel.plan.make_plan` in `choose`).

(Over 400 lines: the search (enumeration, bounds, evaluation) and the explanation of its answer (why each
runner-up lost, what would make a model fit) read the same state; the cost arithmetic is `parallel.plan.cost_model`.)
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import typing
from dataclasses import dataclass, replace

from trainyard.parallel.config import JobConfig, ParallelConfig, ScheduleKind
from trainyard.parallel.models import family_of
from trainyard.parallel.optim.kinds import OPTIMIZERS, optimizer_kind
from trainyard.parallel.plan.admission import ClusterResources
from trainyard.parallel.plan.cost_model import (
    MachineCosts,
    StepCosts,
    fixed_costs,
    option_value,
    pipeline_floor,
    pipeline_sharing,
    ratio_key,
    step_costs,
)
from trainyard.parallel.plan.layout import Gang, Layout, RankCoords, even_layer_counts, stage_layers_of
from trainyard.parallel.plan.memory import rank_memory
from trainyard.parallel.plan.rules import PlanError, violations
from trainyard.parallel.plan.schedule_sim import CheckedSchedule, Costs, check
from trainyard.parallel.plan.schedules import SCHEDULES, build_schedule
from trainyard.parallel.plan.sharding import SHARDINGS
from trainyard.parallel.plan.sizing import Sizing
from trainyard.parallel.plan.units import format_size

MAX_VPP = 4
"""Virtual chunks per pipeline rank tried (more rarely pays: each adds a point-to-point run per micro-batch)."""
MAX_SEARCH_CHUNKS = 2048
"""pp x vpp x microbatches tried at most (the simulator's cost grows with it; more rarely pays)."""
DEFAULT_MARGIN = 0.1
"""Memory kept free on each rank beyond the memory plan's estimate (what it does not count: allocator
caches, kernels' transients)."""


def _literal_values(owner: type, name: str) -> tuple:
    hints = typing.get_type_hints(owner)
    return tuple(v for arg in [hints[name]] for v in typing.get_args(arg) if not isinstance(v, type))


SEARCHED: dict[str, typing.Callable[[], tuple]] = {
    "parallel.zero": lambda: tuple(z for z in _literal_values(ParallelConfig, "zero") if z in SHARDINGS),
    "activation_checkpointing": lambda: _literal_values(JobConfig, "activation_checkpointing"),
    "optimizer.offload": lambda: (False, True),
    "activation_offload": lambda: (False, True),
    "parallel.activation_offload": lambda: (False, True),
}
"""Dotted option -> the values the search tries (an option the config does not have is skipped): one line
per option. Layout-only options: none changes the training's numbers."""
_SCHEDULE_KINDS: tuple[ScheduleKind, ...] = typing.get_args(ScheduleKind)
"""The kinds `parallel.schedule` may name, in SCHEDULES's order (tests/unit/test_schedules.py keeps them equal)."""


@dataclass(frozen=True)
class Candidate:
    """One ranked layout: the concrete config and what the planner predicts of it."""

    config: JobConfig
    step_s: float
    memory_bytes: int
    """The largest rank's estimated memory."""
    bubble: float
    """Simulated bubble fraction of the schedule."""
    terms: dict[str, float]
    """Seconds per step of each part: compute, bubble, tp, ep, dp, optimizer, the options' extras."""
    reason: str = ""
    """Why it lost to the winner (empty for the winner)."""

    def layout_summary(self) -> dict:
        par = self.config.fixed_parallel
        out: dict[str, object] = {"dp": par.dp, "pp": par.pp, "tp": par.tp, "ep": par.ep, "vpp": par.vpp,
                                  "sp": par.sp, "microbatches": par.microbatches, "schedule": par.schedule}
        out.update({path: option_value(self.config, path) for path in _searched_paths(self.config)})
        return out

    def to_dict(self) -> dict:
        return {"layout": self.layout_summary(), "predicted_step_s": self.step_s,
                "memory_per_rank": self.memory_bytes, "bubble_fraction": self.bubble, "terms": self.terms,
                "reason": self.reason}


@dataclass(frozen=True)
class PlannerResult:
    candidates: list[Candidate]
    """The best `top`, best first."""
    enumerated: int
    """Base layouts (degrees, micro-batches, schedule, vpp) enumerated."""
    evaluated: int
    """Layouts whose costs were computed (the rest were pruned by their bound, or by their saver-free sibling's)."""
    node_type: str

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def to_dict(self) -> dict:
        return {"node_type": self.node_type, "enumerated": self.enumerated, "evaluated": self.evaluated,
                "candidates": [c.to_dict() for c in self.candidates]}


def _searched_paths(config: JobConfig) -> list[str]:
    return [path for path in SEARCHED if _has_field(config, path)]


def _has_field(config: JobConfig, path: str) -> bool:
    obj: object = config
    for part in path.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            return False
        obj = getattr(obj, part)
    return True


def _with(config: JobConfig, path: str, value: object) -> JobConfig:
    head, _, rest = path.partition(".")
    new: typing.Any = _with(getattr(config, head), rest, value) if rest else value  # any field's type
    return replace(config, **{head: new})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=4096)
def _schedule(kind: str, pp: int, m: int, vpp: int) -> tuple[tuple, ...]:
    return tuple(map(tuple, build_schedule(kind, pp, m, vpp)))


def _placement(kind: str) -> dict:
    """How a schedule kind seats its virtual stages, as the keyword the layout and the simulator take (none
    while every kind is interleaved; a kind with its own `placement`, a V, passes it on)."""
    placement = getattr(SCHEDULES[kind], "placement", "interleaved")
    return {"placement": placement} if placement != "interleaved" else {}


@functools.lru_cache(maxsize=1024)
def _checked(kind: str, pp: int, vpp: int, m: int) -> CheckedSchedule:
    return check([list(a) for a in _schedule(kind, pp, m, vpp)], m, vpp, **_placement(kind), verify=False)


@functools.lru_cache(maxsize=65536)
def _simulated(kind: str, pp: int, vpp: int, m: int, backward: float, comm: float,
               shared: tuple[float, ...] = ()) -> tuple[float, float]:
    """(makespan in forwards, bubble fraction) of a schedule with forward 1 and these cost ratios."""
    result = _checked(kind, pp, vpp, m).run(Costs(1.0, backward, comm, shared=shared), timeline=False)
    return result.makespan, result.bubble_fraction


class _Sizing(Sizing):
    """A Sizing whose rank coordinates are arithmetic (the layout's own grid is built on first use: thousands
    of ranks, for the one rank per stage the memory plan asks about)."""

    def coords(self, rank: int) -> RankCoords:
        layout = self.layout
        pp, rest = divmod(rank, layout.dp * layout.tp)
        dp, tp = divmod(rest, layout.tp)
        return RankCoords(rank=rank, pp=pp, tp=tp, dp=dp)


@dataclass(frozen=True, order=True)
class _Base:
    bound: float
    dp: int
    pp: int
    tp: int
    ep: int
    sp: bool
    m: int
    kind: ScheduleKind
    vpp: int


class _Search:
    def __init__(self, config: JobConfig, cluster: ClusterResources, machine: MachineCosts, margin: float):
        self.config, self.cluster, self.machine, self.margin = config, cluster, machine, margin
        self.gpus = 1 if cluster.gpus > 0 else 0
        if config.resources.gpus_per_worker != "auto":
            self.gpus = config.resources.gpus_per_worker
        self.cpus = config.resources.cpus_per_worker
        nodes = [{"CPU": n.cpus, "GPU": n.gpus} for n in cluster.nodes]
        self.nodes = nodes
        # ranks a node holds: a rank takes `gpus_per_worker` of its GPUs, or (CPU ranks) cpus_per_worker of its cores
        per_node = [math.floor((n.gpus / self.gpus if self.gpus else n.cpus / self.cpus) + 1e-9) for n in cluster.nodes]
        self.node_ranks = max(per_node, default=0)
        self.smallest: tuple[int, JobConfig] | None = None
        self.paths = _searched_paths(config)
        self.values = {path: SEARCHED[path]() for path in self.paths}
        self.evaluated = 0

    def capacity(self, tp: int) -> int:
        return Gang.of(self.cpus, self.gpus, tp=tp, groups=1).placeable(self.nodes) * tp

    def bases(self) -> list[_Base]:
        c, m = self.config, self.config.model
        fpt = family_of(m).flops_per_token(m)
        tokens = c.global_batch * m.seq_len
        self.params = fpt / 6 * 0.9  # the matmul parameters, about (flops_per_token = 6 N + attention)
        out = []
        tps = [t for t in _divisors(m.n_head) if m.vocab_size % t == 0 and self.capacity(t) >= t]
        for tp in tps:
            cap = self.capacity(tp)
            for dp in _divisors(c.global_batch):
                if dp * tp > cap:
                    break
                eps = [e for e in _divisors(dp) if m.moe.experts % e == 0] if m.moe else [1]
                for pp in range(1, min(m.n_layer, cap // (dp * tp)) + 1):  # every world size: fewer ranks
                    # can be faster (fixed costs, ranks sharing cores), and the bounds prune the slow ones
                    if m.n_layer % pp:
                        continue  # even stages only (the planner does not search uneven stage_layers)
                    micro = [mb for mb in _divisors(c.global_batch // dp)
                             if pp * mb <= MAX_SEARCH_CHUNKS and (pp == 1 or mb >= pp)]
                    for sp, ep, mb in itertools.product((False, True) if tp > 1 else (False,), eps, micro):
                        for kind, vpp in self._schedules(pp, mb):
                            out.append(_Base(self._bound(fpt, tokens, dp, pp, tp, mb, vpp), dp, pp, tp, ep, sp, mb,
                                             kind, vpp))
        return out

    def _schedules(self, pp: int, m: int) -> list[tuple[ScheduleKind, int]]:
        n_layer = self.config.model.n_layer
        vpps = range(1, MAX_VPP + 1) if pp > 1 else (1,)  # one rank: virtual chunks only add hand-overs
        kinds = [(kind, vpp) for kind in _SCHEDULE_KINDS for vpp in vpps if n_layer % (pp * vpp) == 0
                 and pp * vpp * m <= MAX_SEARCH_CHUNKS and SCHEDULES[kind].refuse(pp, m, vpp) is None]
        if pp == 1:  # one pipeline rank runs every kind alike: the spec's own, else the first that takes it
            kinds = [k for k in kinds if k[0] == self.config.fixed_parallel.schedule] or kinds[:1]
        return kinds

    def _bound(self, fpt: float, tokens: int, dp: int, pp: int, tp: int, m: int, vpp: int) -> float:
        """About a lower bound of the step time: the rank's share of the FLOPs (3 x forward) and of the kernels'
        latencies, the pipeline's fill of pp - 1 chunk forwards before the last stage starts, the gradient
        all-reduce of the rank's share of the parameters beyond what one micro-batch's backward hides, and the
        cheapest sharding level's optimizer step with its parameter all-gathers."""
        n_layer, world = self.config.model.n_layer, dp * pp * tp
        on_node = min(world, self.node_ranks or world)
        slow = self.machine.slowdown(on_node)
        flops = fpt * tokens / world
        fixed = sum(fixed_costs(self.machine, max(n_layer // pp, 1), tp, False, pp))
        compute = slow * (flops / self.machine.flops_per_s(self.config.model.d_model) + m * fixed)
        grads = 4 * self.params / (pp * tp) * (0.5 if self.config.fixed_parallel.reduce_dtype == "bf16" else 1)
        reduce = self.machine.collective("allreduce", grads, dp, spans_nodes=dp * tp > self.node_ranks)
        mb_tokens = tokens // (dp * m)
        act = mb_tokens * self.config.model.d_model * (2 if self.config.precision == "bf16" else 4)
        tp_comm = 4 * n_layer * m * self.machine.collective("allreduce", act, tp) / pp
        local = int(self.params / (pp * tp))
        levels = self.values.get("parallel.zero", (self.config.fixed_parallel.zero,))

        def step_end(zero: int) -> float:  # the optimizer's step on a level's shard, and its parameter gathers
            sharding = SHARDINGS[zero]
            gathers = sharding.gathers_per_step(m) * self.machine.collective(
                "allgather", 4 * local, dp, spans_nodes=dp * tp > self.node_ranks)
            return slow * self.machine.optimizer.time(sharding.optimizer_elements(local, dp)) + gathers

        optimizer = slow * self.machine.step_s + min(step_end(z) for z in (levels if dp > 1 else levels[:1]))
        hidden = 0.8 * (compute + tp_comm) / m  # one micro-batch's backward, with some room for uneven stages
        dp_fixed = slow * self.machine.dp_step_s if dp > 1 else 0.0
        busy = compute + tp_comm
        span = pipeline_floor(pipeline_sharing(self.machine, pp, world, on_node), busy,
                              busy * (pp - 1) / (3 * m * vpp))  # the fill: pp - 1 chunk forwards
        return span + max(reduce - hidden, 0.0) + dp_fixed + optimizer

    def saver_free(self, config: JobConfig) -> bool:
        """Whether every searched option but the sharding level is at its first value (off: no recompute, no
        offload), which the others only add time to."""
        return all(option_value(config, path) == self.values[path][0] for path in self.paths if path != "parallel.zero")

    def variants(self, base: _Base) -> list[JobConfig]:
        par = replace(self.config.fixed_parallel, dp=base.dp, pp=base.pp, tp=base.tp, ep=base.ep, sp=base.sp,
                      vpp=base.vpp, microbatches=base.m, schedule=base.kind, stage_layers=None)
        config = replace(self.config, parallel=par)
        paths = self.paths
        values = []
        for path in paths:
            vals = self.values[path]
            if path == "parallel.zero" and base.dp == 1:
                vals = vals[:1]  # no data-parallel group to shard over: every level is level 0
            values.append(vals)
        out = [config]  # every combination, in itertools.product's order, each prefix built once
        for path, vals in zip(paths, values, strict=True):
            out = [_with(cfg, path, v) for cfg in out for v in vals]
        return out

    def layout(self, config: JobConfig, with_schedule: bool = True) -> Layout:
        par, moe = config.fixed_parallel, config.model.moe
        counts = even_layer_counts(config.model.n_layer, par.pp * par.vpp)
        return Layout(dp=par.fixed_dp, pp=par.pp, tp=par.tp, ep=par.ep, vpp=par.vpp, microbatches=par.microbatches,
                      micro_batch_size=config.global_batch // (par.fixed_dp * par.microbatches),
                      stage_layers=stage_layers_of(counts),
                      schedule=_schedule(par.schedule, par.pp, par.microbatches, par.vpp) if with_schedule else (),
                      experts=moe.experts if moe else 0, gpus_per_worker=self.gpus, cpus_per_worker=self.cpus,
                      **_placement(par.schedule))

    def rank_capacity(self, layout: Layout) -> float:
        """Bytes a rank may hold (admission's rule: one GPU's memory, or a CPU rank's share of its node's); 0:
        unknown."""
        if layout.gpus_per_worker:
            return max((n.gpu_memory for n in self.cluster.nodes if n.gpus > 0), default=0.0)
        gang = layout.gang
        shares = [n.memory / (layout.tp * held) for n in self.cluster.nodes
                  if n.memory > 0 and (held := min(gang.count, gang.placeable([{"CPU": n.cpus, "GPU": n.gpus}])))]
        return max(shares, default=0.0)

    def costs(self, config: JobConfig) -> StepCosts | None:
        """The layout's per-chunk and per-step costs; None when it breaks a rule."""
        if violations(config):
            return None
        self.evaluated += 1
        return step_costs(self.layout(config, with_schedule=False), config, self.machine, node_gpus=self.node_ranks)

    def evaluate(self, config: JobConfig, costs: StepCosts | None = None) -> Candidate | None:
        """The layout's prediction; None when it breaks a rule or does not fit."""
        costs = costs or self.costs(config)
        if costs is None:
            return None
        layout = self.layout(config)
        have = self.rank_capacity(layout) * (1 - self.margin)
        sizing = _Sizing(layout, config)
        memory = 0
        for stage in dict.fromkeys((0, layout.pp - 1, layout.pp // 2)):  # the first holds most activations,
            memory = max(memory, rank_memory(sizing, layout.rank_of(stage, 0, 0))  # the last the head
                         .resident(bool(layout.gpus_per_worker)))
            if have > 0 and memory > have:
                break
        if self.smallest is None or memory < self.smallest[0]:
            self.smallest = (memory, config)
        if have > 0 and memory > have:
            return None
        return predict(layout, config, costs, memory)


def lower_bound(layout: Layout | ParallelConfig, costs: StepCosts) -> float:
    """The step time no schedule beats with these costs: every chunk's forward and backward on one rank, after
    the pp - 1 forwards and hand-overs the last stage waits for before its first one, and the terms outside."""
    busy = layout.microbatches * layout.vpp * (costs.forward + costs.backward)
    span = pipeline_floor(costs.shared, busy, (layout.pp - 1) * costs.forward, (layout.pp - 1) * costs.comm)
    return span + costs.dp_exposed + costs.optimizer + sum(costs.extras.values())


def predict(layout: Layout, config: JobConfig, costs: StepCosts, memory: int = 0) -> Candidate:
    """The predicted step of a layout from its costs: the simulated makespan plus what runs outside it."""
    m, vpp = layout.microbatches, layout.vpp
    f = max(costs.forward, 1e-12)
    if layout.pp > 1:
        span, bubble = _simulated(config.fixed_parallel.schedule, layout.pp, vpp, m, ratio_key(costs.backward / f),
                                  ratio_key(costs.comm / f), tuple(map(ratio_key, costs.shared)))
        makespan = span * f
    else:
        makespan, bubble = m * vpp * (costs.forward + costs.backward), 0.0
    busy = m * vpp * (costs.forward + costs.backward)
    terms = {"compute": m * vpp * costs.compute_per_chunk, "bubble": max(makespan - busy, 0.0),
             "tp all-reduce": m * vpp * costs.tp_per_chunk, "ep all-to-all": m * vpp * costs.ep_per_chunk,
             "dp all-reduce": costs.dp_exposed, "optimizer": costs.optimizer, **costs.extras}
    step = makespan + costs.dp_exposed + costs.optimizer + sum(costs.extras.values())
    return Candidate(config=config, step_s=step, memory_bytes=memory, bubble=bubble, terms=terms)


def predict_step(config: JobConfig, layout: Layout, machine: MachineCosts, node_gpus: int = 0) -> float:
    """A fixed layout's predicted step time (item 4: the job's rows carry it beside the measured one)."""
    return predict(layout, config, step_costs(layout, config, machine, node_gpus=node_gpus)).step_s


def plan_layouts(config: JobConfig, cluster: ClusterResources, machine: MachineCosts, *, top: int = 5,
                 margin: float = DEFAULT_MARGIN) -> PlannerResult:
    """The `top` fastest layouts that keep the rules and fit, best first, each with why it lost to the best.
    Raises PlanError (field `parallel`) when none fits, naming the smallest per-rank memory found and what
    would make it fit; when none keeps the rules, the rule a one-rank layout breaks (its own field: the model's,
    the data's, an option's), else that the cluster is too small."""
    search = _Search(config, cluster, machine, margin)
    bases = search.bases()
    enumerated = len(bases)
    # Best first over one queue of bases (keyed by their cheap bound) and of their variants (by the lower bound
    # of their costs, which needs no memory plan and no simulation): a variant is sized and simulated only when
    # nothing in the queue can come before it, and the search ends when nothing left can beat the top-th found.
    queue: list[tuple[float, int, _Base, tuple[JobConfig, StepCosts | None] | None]] = [
        (b.bound, i, b, None) for i, b in enumerate(bases)]
    heapq.heapify(queue)
    pushed = len(queue)
    found: list[Candidate] = []
    cutoff = math.inf
    while queue:
        key, _, base, variant = heapq.heappop(queue)
        if key >= cutoff:
            break
        if variant is None or variant[1] is None:
            # a base: its variants with no saver on get their costs, the others wait keyed by their sibling's
            # bound (a saver only adds time: recompute, offload copies); a waiting variant: its own costs
            waiting = [variant[0]] if variant else search.variants(base)
            floor: dict[int, float] = {}
            for config_ in sorted(waiting, key=lambda c: not search.saver_free(c)):
                if variant is None and not search.saver_free(config_):
                    bound, costs = floor.get(config_.fixed_parallel.zero, key), None
                elif (costs := search.costs(config_)) is None:
                    continue
                else:
                    bound = floor[config_.fixed_parallel.zero] = lower_bound(config_.fixed_parallel, costs)
                if bound < cutoff:
                    heapq.heappush(queue, (bound, pushed, base, (config_, costs)))
                    pushed += 1
            continue
        cand = search.evaluate(*variant)
        if cand is not None:
            found = sorted([*found, cand], key=lambda c: (c.step_s, c.memory_bytes))[: 8 * top]
            cutoff = found[top - 1].step_s if len(found) >= top else math.inf  # what a layout must beat to be shown
    if not found:
        raise no_fit_error(config, cluster, search)
    found = _distinct(found)
    best = found[0]
    ranked = [best] + [replace(c, reason=why_lost(c, best)) for c in found[1:top]]
    return PlannerResult(candidates=ranked, enumerated=enumerated,
                         evaluated=search.evaluated, node_type=machine.node_type)


def _distinct(found: list[Candidate]) -> list[Candidate]:
    """One of each set of layouts that differ only in a schedule that cannot matter (one pipeline rank)."""
    seen, out = set(), []
    for c in found:
        summary = c.layout_summary()
        if c.config.fixed_parallel.pp == 1:
            summary["schedule"] = ""
        key = tuple(summary.items())
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def why_lost(c: Candidate, best: Candidate) -> str:
    """The part of the step where the runner-up loses most to the winner."""
    if c.step_s <= best.step_s:
        return f"same predicted step time; more memory per rank ({format_size(c.memory_bytes)} vs " \
               f"{format_size(best.memory_bytes)})"
    name = max(set(c.terms) | set(best.terms), key=lambda k: c.terms.get(k, 0.0) - best.terms.get(k, 0.0))
    if name == "bubble":
        return f"bubble {c.bubble:.0%} vs {best.bubble:.0%} ({_ms(c.terms['bubble'] - best.terms['bubble'])} more)"
    more = c.terms.get(name, 0.0) - best.terms.get(name, 0.0)
    return f"{name} {_ms(more)}/step more"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def no_fit_error(config: JobConfig, cluster: ClusterResources, search: _Search) -> PlanError:
    if search.smallest is None:
        one_rank = replace(config.fixed_parallel, dp=1, pp=1, tp=1, ep=1, vpp=1, sp=False, microbatches=1,
                           schedule="1f1b", stage_layers=None)
        broken = violations(replace(config, parallel=one_rank))
        if broken:  # a rule no layout can keep (the model's, the data's, the options'): named as a layout names it
            return broken[0]
        return PlanError("parallel", f"no layout keeps the rules on this cluster ({len(cluster.nodes)} node(s), "
                                     f"{cluster.gpus:g} GPU, {cluster.cpus:g} CPU): check global_batch, n_head and "
                                     "n_layer against the cluster's size")
    memory, smallest = search.smallest
    layout = search.layout(smallest)
    have = search.rank_capacity(layout) * (1 - search.margin)
    par = smallest.fixed_parallel
    nodes = math.ceil(len(cluster.nodes) * memory / max(have, 1.0))
    fixes = [f"more nodes (about {nodes} of this kind, if the model splits that far)"]
    kind = optimizer_kind(config.optimizer)
    d, n = config.model.d_model, 10**6  # state bytes per parameter, over a million parameters
    per_param = {name: o.state_bytes(n, d) / n for name, o in OPTIMIZERS.items()}
    fixes += [f"optimizer.kind: {name} (about {b:.2g} B of state per parameter instead of {per_param[kind.name]:.2g})"
              for name, b in per_param.items() if b < per_param[kind.name]]
    tried = [f"{path} in {list(SEARCHED[path]())}" for path in _searched_paths(config)]
    return PlanError("parallel", f"no layout fits: the smallest per-rank memory found is {format_size(memory)} "
                                 f"(dp={par.dp} pp={par.pp} tp={par.tp} microbatches={par.microbatches}) but a rank "
                                 f"may hold {format_size(have)} ({search.margin:.0%} kept free); would fit with: "
                                 + "; ".join(fixes) + " (the search already tried " + ", ".join(tried) + ")")


def choose(config: JobConfig, cluster: ClusterResources, machine: MachineCosts, *, top: int = 5,
           margin: float = DEFAULT_MARGIN) -> tuple[JobConfig, PlannerResult]:
    """`parallel: auto` resolved: the fastest layout that `parallel.plan.make_plan` admits on the cluster (the
    exact memory plan of every rank), as the config to run, noted as chosen automatically with its predicted
    step time; and the ranking. Raises PlanError when none fits."""
    from trainyard.parallel.config import PlannerNote
    from trainyard.parallel.plan import make_plan

    base = replace(config, parallel=ParallelConfig()) if config.parallel == "auto" else config
    result = plan_layouts(base, cluster, machine, top=top, margin=margin)
    refused: PlanError | None = None
    for cand in result.candidates:
        try:
            make_plan(cand.config, cluster)
        except PlanError as e:
            refused = refused or e
            continue
        note = PlannerNote(chosen_automatically=True, predicted_step_s=cand.step_s, node_type=machine.node_type)
        return replace(cand.config, planned=note), result
    raise refused or PlanError("parallel", "no layout fits")
