"""What the planner predicts of one layout: its `Candidate` (step time, memory, the terms of the step), the
ranked `PlannerResult`, the lower bound no schedule beats, and the simulated makespan behind a prediction.

The schedules are built and checked once per (kind, pp, micro-batches, vpp) and simulated once per cost ratios
(lru caches): the search asks for the same ones thousands of times. The planner's own schedules, checked by
their tests, are not verified again. Pure: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from trainyard.parallel.config import JobConfig, ParallelConfig
from trainyard.parallel.plan.layout import Layout
from trainyard.parallel.plan.planner.cost_model import StepCosts, option_value, pipeline_floor, ratio_key, step_costs
from trainyard.parallel.plan.planner.machine_costs import MachineCosts
from trainyard.parallel.plan.planner.search_options import searched_paths
from trainyard.parallel.plan.schedule.schedule_sim import check
from trainyard.parallel.plan.schedule.schedule_timing import CheckedSchedule, Costs
from trainyard.parallel.plan.schedule.schedules import build_schedule, placement_of
from trainyard.parallel.plan.sizing import fixed_parallel


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
    """Seconds per step of each part: compute, bubble, tp, ep, the cp ring, dp, optimizer, the options' extras."""
    reason: str = ""
    """Why it lost to the winner (empty for the winner)."""

    def layout_summary(self) -> dict:
        par = fixed_parallel(self.config)
        out: dict[str, object] = {"dp": par.dp, "cp": par.cp, "pp": par.pp, "tp": par.tp, "ep": par.ep, "vpp": par.vpp,
                                  "sp": par.sp, "microbatches": par.microbatches, "schedule": par.schedule}
        out.update({path: option_value(self.config, path) for path in searched_paths(self.config)})
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
    bounds: str = ""
    """What the search left out (`planner_search.Search.bounds`)."""

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def to_dict(self) -> dict:
        return {"node_type": self.node_type, "enumerated": self.enumerated, "evaluated": self.evaluated,
                "bounds": self.bounds,
                "candidates": [c.to_dict() for c in self.candidates]}


@functools.lru_cache(maxsize=4096)
def cached_schedule(kind: str, pp: int, m: int, vpp: int) -> tuple[tuple, ...]:
    return tuple(map(tuple, build_schedule(kind, pp, m, vpp)))


@functools.lru_cache(maxsize=1024)
def _checked(kind: str, pp: int, vpp: int, m: int) -> CheckedSchedule:
    return check([list(a) for a in cached_schedule(kind, pp, m, vpp)], m, vpp, placement_of(kind), verify=False)


@functools.lru_cache(maxsize=65536)
def _simulated(kind: str, pp: int, vpp: int, m: int, backward: float, comm: float,
               shared: tuple[float, ...] = ()) -> tuple[float, float]:
    """(makespan in forwards, bubble fraction) of a schedule with forward 1 and these cost ratios."""
    result = _checked(kind, pp, vpp, m).run(Costs(1.0, backward, comm, shared=shared), timeline=False)
    return result.makespan, result.bubble_fraction


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
        span, bubble = _simulated(fixed_parallel(config).schedule, layout.pp, vpp, m, ratio_key(costs.backward / f),
                                  ratio_key(costs.comm / f), tuple(map(ratio_key, costs.shared)))
        makespan = span * f
    else:
        makespan, bubble = m * vpp * (costs.forward + costs.backward), 0.0
    busy = m * vpp * (costs.forward + costs.backward)
    terms = {"compute": m * vpp * costs.compute_per_chunk, "bubble": max(makespan - busy, 0.0),
             "tp all-reduce": m * vpp * costs.tp_per_chunk, "ep all-to-all": m * vpp * costs.ep_per_chunk,
             "cp ring": m * vpp * costs.cp_per_chunk,
             "dp all-reduce": costs.dp_exposed, "optimizer": costs.optimizer, **costs.extras}
    step = makespan + costs.dp_exposed + costs.optimizer + sum(costs.extras.values())
    return Candidate(config=config, step_s=step, memory_bytes=memory, bubble=bubble, terms=terms)


def predict_step(config: JobConfig, layout: Layout, machine: MachineCosts, node_gpus: int = 0) -> float:
    """A fixed layout's predicted step time (item 4: the job's rows carry it beside the measured one)."""
    return predict(layout, config, step_costs(layout, config, machine, node_gpus=node_gpus)).step_s
