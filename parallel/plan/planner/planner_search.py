"""The planner's search state: the base layouts it enumerates (degrees, micro-batches, schedule, vpp) with a cheap
lower bound on each, the variants of a base (the searched options), and a variant's costs, memory and prediction.

The cp degrees tried (`cp_degrees`) are those `parallel.plan.rules.context_parallel_violations` lets the model take
whatever the other degrees: 2 x cp divides seq_len, a family whose attention runs the ring, no MoE, no local sync, no
compile (cp's rule on sp and tp is the layout's, checked with the other rules as each layout is costed).

`parallel.plan.planner.planner.plan_layouts` drives it best first; the memory check reads the first, middle and last
stage only. Pure: no torch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from trainyard.parallel.config import JobConfig
from trainyard.parallel.models import family_of
from trainyard.parallel.names import SCHEDULE_KINDS, ScheduleKind
from trainyard.parallel.plan.admission import ClusterResources
from trainyard.parallel.plan.layout import Gang, Layout, RankCoords, even_layer_counts, stage_layers_of
from trainyard.parallel.plan.memory.estimate import rank_memory
from trainyard.parallel.plan.planner.cost_model import (
    StepCosts,
    fixed_costs,
    option_value,
    p2p_time,
    pipeline_floor,
    pipeline_sharing,
    step_costs,
)
from trainyard.parallel.plan.planner.machine_costs import MachineCosts
from trainyard.parallel.plan.planner.prediction import Candidate, cached_schedule, predict
from trainyard.parallel.plan.planner.search_options import searched_paths, searched_values, with_option
from trainyard.parallel.plan.rules import PlanError, context_parallel_violations, violations
from trainyard.parallel.plan.schedule.schedules import SCHEDULES, placement_of
from trainyard.parallel.plan.sharding import SHARDINGS
from trainyard.parallel.plan.sizing import Resolved, Sizing, fixed_parallel
from trainyard.parallel.plan.sync.replica_sync import layout_replica_dp

MAX_VPP = 4
"""Virtual chunks per pipeline rank tried (more rarely pays: each adds a point-to-point run per micro-batch)."""
MAX_SEARCH_CHUNKS = 2048
"""pp x vpp x microbatches tried at most (the simulator's cost grows with it; more rarely pays)."""
SCALE_RANKS = 64
"""Past this many GPU ranks the search is bounded for speed (a 1T model on 3072 GPUs answers in seconds):
every layout uses every GPU (fewer ranks pay only where ranks share cores, which GPU ranks do not), and at most
MAX_SIZED_AT_SCALE layouts are sized and simulated, best bound first (`Search.bounds` says so in the result)."""
MAX_SIZED_AT_SCALE = 500
"""Layouts sized (memory plan) and simulated at most past SCALE_RANKS: as many at cp 1 and, apart, at cp > 1 (so
the cp layouts, which share their bounds with their dp twins, never spend what the cp-1 search had before them)."""
CP_AT_SCALE = "cp > 1 only where a rank's micro-batch is one sequence"
"""Past SCALE_RANKS, what else keeps the cp layouts few (a heuristic, as the budget is): a micro-batch of b > 1
sequences whose b cp divides has a twin at dp x cp and cp 1 (the same tokens a rank, the same gradient group, no
ring; the memory plan measured it 1-4% above the cp layout's at 1024 tokens), and one that cp does not divide
splits unevenly into its sequences; a micro-batch of one sequence is where only cp splits it further (beside tp
and pp). Below SCALE_RANKS every cp layout is searched."""


_RECOMPUTE_LEAN = {"none": 0.0, "selective": 1.0, "full": 2.0}


def _lean_key(value: object) -> float:
    """An option's value by how little it leaves on the device: True over False, a higher level over a lower,
    full recompute over selective over none."""
    if isinstance(value, str):
        return _RECOMPUTE_LEAN.get(value, 0.0)
    return float(value) if isinstance(value, bool | int | float) else 0.0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_refusal(config: JobConfig, cp: int = 2) -> PlanError | None:
    """The rule that refuses context parallelism of `cp` ranks for this model whatever the other degrees
    (`context_parallel_violations` naming `parallel.cp`, asked of a one-rank layout at that cp); None: none does."""
    one_rank = replace(fixed_parallel(config), dp=1, pp=1, tp=1, ep=1, vpp=1, sp=False, microbatches=1, cp=cp,
                       stage_layers=None)
    errors = context_parallel_violations(Resolved(replace(config, parallel=one_rank)))
    return next((e for e in errors if e.field == "parallel.cp"), None)


def cp_degrees(config: JobConfig, most: int) -> list[int]:
    """1 and every cp up to `most` ranks the rules let this model take (`cp_refusal`): 2 x cp divides seq_len."""
    half = config.model.seq_len // 2
    return [1] + [cp for cp in range(2, min(most, half) + 1) if half % cp == 0 and cp_refusal(config, cp) is None]


class _Sizing(Sizing):
    """A Sizing whose rank coordinates are arithmetic (the layout's own grid is built on first use: thousands
    of ranks, for the one rank per stage the memory plan asks about)."""

    def coords(self, rank: int) -> RankCoords:
        layout = self.layout
        pp, rest = divmod(rank, layout.dp * layout.cp * layout.tp)
        dp, rest = divmod(rest, layout.cp * layout.tp)
        cp, tp = divmod(rest, layout.tp)
        return RankCoords(rank=rank, pp=pp, tp=tp, dp=dp, cp=cp)


@dataclass(frozen=True, order=True)
class BaseLayout:
    bound: float
    dp: int
    pp: int
    tp: int
    ep: int
    sp: bool
    m: int
    kind: ScheduleKind
    vpp: int
    cp: int = 1


class Search:
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
        self.paths = searched_paths(config)
        self.values = searched_values(config)
        self.evaluated = 0
        self.sized = 0
        self.sized_apart = {False: 0, True: 0}
        """Layouts sized at cp 1 (False) and at cp > 1 (True): a MAX_SIZED_AT_SCALE budget each."""
        self.gated: dict[tuple, bool] = {}
        self.failed: dict[tuple, list[tuple[float, ...]]] = {}
        self.at_scale = bool(self.gpus) and sum(per_node) > SCALE_RANKS
        self.cps: list[int] = [1]
        """The cp degrees the search tries (`cp_degrees`; set by `bases`)."""
        self.cp_refused: PlanError | None = None
        """The rule that kept the search at cp = 1 whatever the cluster, if one did."""

    def capacity(self, tp: int) -> int:
        return Gang.of(self.cpus, self.gpus, tp=tp, groups=1).placeable(self.nodes) * tp

    def bases(self) -> list[BaseLayout]:
        c, m = self.config, self.config.model
        fpt = family_of(m).flops_per_token(m)
        tokens = c.global_batch * m.seq_len
        # the matmul parameters, about (flops_per_token = 6 N + 12 L d T: a long sequence's attention is no parameter)
        self.params = max(fpt - 12 * m.n_layer * m.d_model * m.seq_len, 0.0) / 6 * 0.9
        out = []
        caps = {t: self.capacity(t) for t in _divisors(m.n_head) if m.vocab_size % t == 0}
        caps = {t: cap for t, cap in caps.items() if cap >= t}
        cps = self.cps = cp_degrees(c, max(caps.values(), default=1))
        self.cp_refused = cp_refusal(c) if cps == [1] else None
        for tp, dp, cp in itertools.product(caps, _divisors(c.global_batch), cps):
            cap = caps[tp]
            if dp * cp * tp > cap:
                continue
            eps = [e for e in _divisors(dp) if m.moe.experts % e == 0] if m.moe else [1]
            for pp in range(1, min(m.n_layer, cap // (dp * cp * tp)) + 1):  # every world size: fewer ranks
                # can be faster (fixed costs, ranks sharing cores), and the bounds prune the slow ones
                if m.n_layer % pp:
                    continue  # even stages only (the planner does not search uneven stage_layers)
                if self.at_scale and dp * cp * tp * pp != cap:
                    continue  # at scale every GPU is used (SCALE_RANKS)
                micro = [mb for mb in _divisors(c.global_batch // dp)
                         if pp * mb <= MAX_SEARCH_CHUNKS and (pp == 1 or mb >= pp)]
                for sp, ep, mb in itertools.product((False, True) if tp > 1 else (False,), eps, micro):
                    if self.at_scale and cp > 1 and c.global_batch // (dp * mb) > 1:
                        continue  # at scale: cp only splits a micro-batch of one sequence (CP_AT_SCALE)
                    for kind, vpp in self._schedules(pp, mb):
                        bound = self._bound(fpt, tokens, dp * cp, pp, tp, mb, vpp, cp)
                        out.append(BaseLayout(bound, dp, pp, tp, ep, sp, mb, kind, vpp, cp))
        return out

    def _schedules(self, pp: int, m: int) -> list[tuple[ScheduleKind, int]]:
        n_layer = self.config.model.n_layer
        vpps = range(1, MAX_VPP + 1) if pp > 1 else (1,)  # one rank: virtual chunks only add hand-overs
        kinds = [(kind, vpp) for kind in SCHEDULE_KINDS for vpp in vpps if n_layer % (pp * vpp) == 0
                 and pp * vpp * m <= MAX_SEARCH_CHUNKS and SCHEDULES[kind].refuse(pp, m, vpp) is None
                 and not SCHEDULES[kind].delays_update]  # 2bw changes the numbers: only by name
        if pp == 1:  # one pipeline rank runs every kind alike: the spec's own, else the first that takes it
            kinds = [k for k in kinds if k[0] == fixed_parallel(self.config).schedule] or kinds[:1]
        return kinds

    def _bound(self, fpt: float, tokens: int, dp: int, pp: int, tp: int, m: int, vpp: int, cp: int = 1) -> float:
        """About a lower bound of the step time: the rank's share of the FLOPs (3 x forward) and of the kernels'
        latencies, the ring's dK/dV shifts under cp, the pipeline's fill of pp - 1 chunk forwards before the last
        stage starts, the gradient all-reduce of the rank's share of the parameters beyond what one micro-batch's
        backward hides, and the cheapest sharding level's optimizer step with its parameter all-gathers. `dp`: the
        ranks that reduce the gradients, dp x cp."""
        model = self.config.model
        n_layer, world = model.n_layer, dp * pp * tp
        on_node = min(world, self.node_ranks or world)
        slow = self.machine.slowdown(on_node)
        flops = fpt * tokens / world
        fixed = sum(fixed_costs(self.machine, max(n_layer // pp, 1), tp, False, pp))
        compute = slow * (flops / self.machine.flops_per_s(self.config.model.d_model) + m * fixed)
        grads = 4 * self.params / (pp * tp) * (0.5 if fixed_parallel(self.config).reduce_dtype == "bf16" else 1)
        reduce = self.machine.collective("allreduce", grads, dp, spans_nodes=dp * tp > self.node_ranks)
        mb_tokens = tokens // (dp * m)
        act = mb_tokens * self.config.model.d_model * (2 if self.config.precision == "bf16" else 4)
        tp_comm = 4 * n_layer * m * self.machine.collective("allreduce", act, tp) / pp
        ring = 0.0
        if cp > 1:  # what nothing hides of the ring (`cost_model.ring_costs`): each block's cp dK/dV shifts
            kv = 2 * 4 * mb_tokens * (model.n_kv_head or model.n_head) / tp * model.head_size
            hop = self.machine.comm_share(on_node) * p2p_time(self.machine, kv, cp * tp > (self.node_ranks or world))
            ring = m * n_layer // pp * cp * hop
        local = int(self.params / (pp * tp))
        levels = self.values.get("parallel.zero", (fixed_parallel(self.config).zero,))

        def step_end(zero: int) -> float:  # the optimizer's step on a level's shard, and its parameter gathers
            sharding = SHARDINGS[zero]
            gathers = sharding.gathers_per_step(m) * self.machine.collective(
                "allgather", 4 * local, dp, spans_nodes=dp * tp > self.node_ranks)
            return slow * self.machine.optimizer.time(sharding.optimizer_elements(local, dp)) + gathers

        optimizer = slow * self.machine.step_s + min(step_end(z) for z in (levels if dp > 1 else levels[:1]))
        hidden = 0.8 * (compute + tp_comm) / m  # one micro-batch's backward, with some room for uneven stages
        dp_fixed = slow * self.machine.dp_step_s if dp > 1 else 0.0
        busy = compute + tp_comm + ring
        span = pipeline_floor(pipeline_sharing(self.machine, pp, world, on_node), busy,
                              busy * (pp - 1) / (3 * m * vpp))  # the fill: pp - 1 chunk forwards
        return span + max(reduce - hidden, 0.0) + dp_fixed + optimizer

    def bounds(self) -> str:
        """The search's bounds, as the result states them."""
        text = (f"even stages only; pp x vpp x microbatches <= {MAX_SEARCH_CHUNKS}; vpp <= {MAX_VPP}; a tp group "
                f"inside one node; cp in {self.cps}")
        if self.cp_refused is not None:
            text += f" ({self.cp_refused.message})"
        if self.at_scale:
            text += (f"; past {SCALE_RANKS} GPU ranks: every GPU used, at most {MAX_SIZED_AT_SCALE} layouts sized "
                     f"and simulated, best bound first ({self.sized} were)")
            if len(self.cps) > 1:
                text += f", as many more at cp > 1; {CP_AT_SCALE}"
        return text

    def exhausted(self, cp: int = 0) -> bool:
        """Whether the bounded search (at scale) has sized as many layouts at this cp's kind (1, or > 1) as it may;
        cp 0: of every kind it searches."""
        kinds = [cp > 1] if cp else [False, True][:1 + (len(self.cps) > 1)]
        return self.at_scale and all(self.sized_apart[k] >= MAX_SIZED_AT_SCALE for k in kinds)

    def leanest(self, base: BaseLayout, variants: list[JobConfig]) -> tuple[bool, Candidate | None]:
        """(whether the variant of a base holding the least (the highest sharding level, full recompute, every
        offload on) fits or breaks a rule the others may keep, its prediction where it fits): sized once,
        counted in `sized`; a base differing only in vpp from one already gated shares its answer."""
        key = (base.dp, base.cp, base.pp, base.tp, base.ep, base.sp, base.m, base.kind)
        if key in self.gated:
            return self.gated[key], None
        lean = variants[0]
        for path in self.paths:
            vals = {v for cfg in variants if (v := option_value(cfg, path)) is not None}
            pick = max(vals, key=_lean_key)
            lean = with_option(lean, path, pick)
        costs = self.costs(lean)
        if costs is None:
            return True, None  # it breaks a rule: the others may keep them
        cand = self.evaluate(lean, costs)
        self.gated[key] = cand is not None
        return cand is not None, cand

    def saver_free(self, config: JobConfig) -> bool:
        """Whether every searched option but the sharding level is at its first value (off: no recompute, no
        offload), which the others only add time to."""
        return all(option_value(config, path) == self.values[path][0] for path in self.paths if path != "parallel.zero")

    def variants(self, base: BaseLayout) -> list[JobConfig]:
        par = replace(fixed_parallel(self.config), dp=base.dp, cp=base.cp, pp=base.pp, tp=base.tp, ep=base.ep,
                      sp=base.sp, vpp=base.vpp, microbatches=base.m, schedule=base.kind, stage_layers=None)
        config = replace(self.config, parallel=par)
        paths = self.paths
        values = []
        for path in paths:
            vals = self.values[path]
            if path == "parallel.zero" and base.dp * base.cp == 1:
                vals = vals[:1]  # no dp x cp group to shard over: every level is level 0
            values.append(vals)
        out = [config]  # every combination, in itertools.product's order, each prefix built once
        for path, vals in zip(paths, values, strict=True):
            out = [with_option(cfg, path, v) for cfg in out for v in vals]
        return out

    def layout(self, config: JobConfig, with_schedule: bool = True) -> Layout:
        par, moe = fixed_parallel(config), config.model.moe
        counts = even_layer_counts(config.model.n_layer, par.pp * par.vpp)
        return Layout(dp=par.fixed_dp, pp=par.pp, tp=par.tp, ep=par.ep, cp=par.cp, vpp=par.vpp,
                      microbatches=par.microbatches,
                      micro_batch_size=config.global_batch // (par.fixed_dp * par.microbatches),
                      stage_layers=stage_layers_of(counts),
                      actions=(cached_schedule(par.schedule, par.pp, par.microbatches, par.vpp)
                               if with_schedule else ()),
                      experts=moe.experts if moe else 0, gpus_per_worker=self.gpus, cpus_per_worker=self.cpus,
                      replica_dp=layout_replica_dp(par.sync, par.fixed_dp),
                      placement=placement_of(par.schedule))

    def rank_capacity(self, layout: Layout) -> float:
        """Bytes a rank may hold (admission's rule: one GPU's memory, or a CPU rank's share of its node's); 0:
        unknown."""
        if layout.gpus_per_worker:
            return max((n.gpu_memory for n in self.cluster.nodes if n.gpus > 0), default=0.0)
        gang = layout.gang
        shares = [n.memory / (layout.tp * held) for n in self.cluster.nodes
                  if n.memory > 0 and (held := min(gang.count, gang.placeable([{"CPU": n.cpus, "GPU": n.gpus}])))]
        return max(shares, default=0.0)

    def host_capacity(self, layout: Layout) -> float:
        """Host bytes a GPU rank may hold (its share of a node's memory, as admission reads it); 0: unknown or a
        CPU rank (whose host memory is its memory: `rank_capacity`)."""
        if not layout.gpus_per_worker or not self.node_ranks:
            return 0.0
        return max((n.memory for n in self.cluster.nodes if n.gpus > 0), default=0.0) / self.node_ranks

    def costs(self, config: JobConfig) -> StepCosts | None:
        """The layout's per-chunk and per-step costs; None when it breaks a rule."""
        if violations(config):
            return None
        self.evaluated += 1
        return step_costs(self.layout(config, with_schedule=False), config, self.machine, node_gpus=self.node_ranks)

    def _leanness(self, config: JobConfig) -> tuple[tuple, tuple[float, ...]]:
        par = fixed_parallel(config)
        key = (par.dp, par.cp, par.pp, par.tp, par.ep, par.sp, par.microbatches, par.schedule, par.vpp)
        return key, tuple(_lean_key(option_value(config, path)) for path in self.paths)

    def evaluate(self, config: JobConfig, costs: StepCosts | None = None) -> Candidate | None:
        """The layout's prediction; None when it breaks a rule or does not fit (at scale, a variant holding no
        less than one that did not fit on every option is not sized again)."""
        costs = costs or self.costs(config)
        if costs is None:
            return None
        if self.at_scale:
            key, lean = self._leanness(config)
            if any(all(a <= b for a, b in zip(lean, worse, strict=True)) for worse in self.failed.get(key, ())):
                return None
        cand = self._evaluate(config, costs)
        if cand is None and self.at_scale:
            self.failed.setdefault(key, []).append(lean)
        return cand

    def _evaluate(self, config: JobConfig, costs: StepCosts) -> Candidate | None:
        layout = self.layout(config)
        self.sized += 1
        self.sized_apart[layout.cp > 1] += 1
        have = self.rank_capacity(layout) * (1 - self.margin)
        host_have = self.host_capacity(layout) * (1 - self.margin)
        sizing = _Sizing(config, layout=layout)
        memory, host = 0, 0
        for stage in dict.fromkeys((0, layout.pp - 1, layout.pp // 2)):  # the first holds most activations,
            need = rank_memory(sizing, layout.rank_of(stage, 0, 0))  # the last the head
            memory = max(memory, need.resident(bool(layout.gpus_per_worker)))
            host = max(host, need.host_resident if layout.gpus_per_worker else 0)
            if (have > 0 and memory > have) or (host_have > 0 and host > host_have):
                break
        if host_have > 0 and host > host_have:  # a GPU rank's offloaded bytes beyond its share of the host's
            return None
        if self.smallest is None or memory < self.smallest[0]:
            self.smallest = (memory, config)
        if have > 0 and memory > have:
            return None
        return predict(layout, config, costs, memory)
