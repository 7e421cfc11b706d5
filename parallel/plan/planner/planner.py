"""The automatic layout planner (`parallel: auto`): the valid layouts of a job on a cluster, ranked by
predicted step time.

`plan_layouts(config, cluster, machine)` enumerates degree tuples (dp, cp, pp, tp, ep, sp), micro-batch counts,
schedules with their vpp (`parallel.plan.schedule.schedules.SCHEDULES`) and, for each, the searched options
(`parallel.plan.planner.search_options.SEARCHED`: the values of `parallel.zero` in `parallel.plan.sharding.SHARDINGS`,
the `activation_checkpointing` modes read off the config's Literal, and any offload switch the config has), so a
new registry entry joins the search with no change here. Options that change the training's numbers (the
optimizer kind, gradient compression, the reduce dtype, local SGD) stay as the user wrote them.

Best first: each (degrees, micro-batches, schedule, vpp) gets a cheap lower bound on its step time (FLOPs / throughput
and the measured fixed costs, slowed by the ranks sharing a node, plus the pipeline's fill and the cheapest sharding
level's optimizer step and gathers). They are taken from one queue in bound order; a base taken puts its variants (the
searched options) in the queue by the lower bound of their costs (the rules, `parallel.plan.rules.violations`, and
`parallel.plan.planner.cost_model.step_costs`, no memory plan, no simulation), a variant with a saver on (recompute,
offload: they only add time) at first by its saver-free sibling's bound. Only a variant taken from the queue is sized
(`parallel.plan.memory.estimate`, with `margin` kept free) and simulated (cached per schedule, pp, vpp, micro-batches
and cost ratios; the planner's own schedules, checked by their tests, are not checked again), until nothing left can
beat the `top`-th best time found. The predicted step time is the simulated makespan with the cost model's per-chunk
costs (`parallel.plan.planner.cost_model`) plus the terms outside the pipeline. Pure: no torch.

Context parallelism is a degree like the others: the cp values the rules let the model take whatever the rest
(`planner_search.cp_degrees`: 2 x cp divides seq_len, a family whose attention runs the ring, no MoE, local sync or
compile), each costed with its ring's exchanges and 1/cp of every sequence's compute and activations, so cp wins
where a long sequence fits no other way or where the cost model finds it faster; a rule that keeps it at 1 is
named in the result's bounds and in the error when nothing fits.

Left out of the search, by hand (`parallel.plan.planner.planner_search`): uneven stages (pp and pp x vpp must
divide n_layer), pipelines with fewer micro-batches than stages, more than MAX_VPP chunks per rank or
MAX_SEARCH_CHUNKS chunk forwards per step; elastic dp ranges. The memory check reads the first, middle and
last stage (the winner is then checked on every rank by `parallel.plan.make_plan` in `choose`).

This module owns the best-first loop and `choose`; the rest lives beside it, one job each:
`parallel.plan.planner.search_options` (what is searched), `parallel.plan.planner.planner_search` (the bases, their
bounds and variants, a variant's memory and costs), `parallel.plan.planner.prediction` (a layout's predicted step, the
ranked result) and `parallel.plan.planner.planner_explain` (why a runner-up lost, what would make a model fit); the cost
arithmetic is `parallel.plan.planner.cost_model`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

from trainyard.parallel.config import JobConfig, ParallelConfig
from trainyard.parallel.plan.admission import ClusterResources
from trainyard.parallel.plan.planner.cost_model import StepCosts
from trainyard.parallel.plan.planner.machine_costs import MachineCosts
from trainyard.parallel.plan.planner.planner_explain import distinct, no_fit_error, why_lost
from trainyard.parallel.plan.planner.planner_search import BaseLayout, Search
from trainyard.parallel.plan.planner.prediction import Candidate, PlannerResult, lower_bound
from trainyard.parallel.plan.rules import PlanError
from trainyard.parallel.plan.sizing import fixed_parallel

DEFAULT_MARGIN = 0.1
"""Memory kept free on each rank beyond the memory plan's estimate (what it does not count: allocator
caches, kernels' transients)."""


def plan_layouts(config: JobConfig, cluster: ClusterResources, machine: MachineCosts, *, top: int = 5,
                 margin: float = DEFAULT_MARGIN) -> PlannerResult:
    """The `top` fastest layouts that keep the rules and fit, best first, each with why it lost to the best.
    Raises PlanError (field `parallel`) when none fits, naming the smallest per-rank memory found and what
    would make it fit; when none keeps the rules, the rule a one-rank layout breaks (its own field: the model's,
    the data's, an option's), else that the cluster is too small."""
    search = Search(config, cluster, machine, margin)
    bases = search.bases()
    enumerated = len(bases)
    # Best first over one queue of bases (keyed by their cheap bound) and of their variants (by the lower bound
    # of their costs, which needs no memory plan and no simulation): a variant is sized and simulated only when
    # nothing in the queue can come before it, and the search ends when nothing left can beat the top-th found.
    queue: list[tuple[float, int, BaseLayout, tuple[JobConfig, StepCosts | None] | None]] = [
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
            if variant is None and search.at_scale:  # a base whose leanest variant does not fit: dropped whole
                if search.exhausted(base.cp):
                    continue
                fits, lean = search.leanest(base, waiting)
                if lean is not None:
                    found = _ranked([*found, lean], top)
                    cutoff = found[top - 1].step_s if len(found) >= top else math.inf
                if not fits:
                    continue
            floor: dict[int, float] = {}
            for config_ in sorted(waiting, key=lambda c: not search.saver_free(c)):
                if variant is None and not search.saver_free(config_):
                    bound, costs = floor.get(fixed_parallel(config_).zero, key), None
                elif (costs := search.costs(config_)) is None:
                    continue
                else:
                    bound = floor[fixed_parallel(config_).zero] = lower_bound(fixed_parallel(config_), costs)
                if bound < cutoff:
                    heapq.heappush(queue, (bound, pushed, base, (config_, costs)))
                    pushed += 1
            continue
        if search.exhausted():
            break  # the bounded search at scale (planner_search.SCALE_RANKS) has sized all it may
        if search.exhausted(base.cp):
            continue  # it may still size layouts of the other kind (cp 1, cp > 1: a budget each)
        cand = search.evaluate(*variant)
        if cand is not None:
            found = _ranked([*found, cand], top)
            cutoff = found[top - 1].step_s if len(found) >= top else math.inf  # what a layout must beat to be shown
    if not found:
        raise no_fit_error(config, cluster, search)
    found = distinct(found)
    best = found[0]
    ranked = [best] + [replace(c, reason=why_lost(c, best)) for c in found[1:top]]
    return PlannerResult(candidates=ranked, enumerated=enumerated,
                         evaluated=search.evaluated, node_type=machine.node_type, bounds=search.bounds())


def _ranked(found: list[Candidate], top: int) -> list[Candidate]:
    return sorted(found, key=lambda c: (c.step_s, c.memory_bytes))[: 8 * top]


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
