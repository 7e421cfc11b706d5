"""The plan room: everything decided before a rank starts, in pure Python (no torch).

Owns the layout (`layout`), the rules between fields (`rules`), admission (`admission`), the memory plan (`memory`),
the ZeRO strategies (`sharding`), the replica sync modes' and the gradient compressors' pure facts
(`replica_sync`, `grad_compression`), pipeline schedules in their action vocabulary (`schedules`, `actions`) and their
simulator (`schedule_sim`: the checks, `schedule_timing`: the run), the cost model (`cost_model`, over what a
calibration measured: `machine_costs`), calibration's fits and cache (`calibration`; the measuring run is
`parallel.runtime.calibrate`), the automatic planner (`planner`, with `search_options`, `planner_search`,
`prediction`, `planner_explain`), and the plan as data for the API (`present`). `make_plan(config, cluster)` (in
`job_plan`) returns the frozen `Plan` every other room reads, each strategy its config names resolved once
(`sizing`: `plan.parallel`, `plan.sharding`, `plan.schedule`, `plan.optimizer`, `plan.family`), and which ranks
reduce which gradients is `reduction_sets`'. May import `parallel.config`, `parallel.seeds`,
`parallel.models` (its registry and counting) and `parallel.optim.kinds` (the optimizer registry); never torch,
`runtime`, `data` or `io`.
"""

from trainyard.parallel.plan.admission import ClusterResources, NodeResources
from trainyard.parallel.plan.job_plan import (
    Plan,
    can_move_in_memory,
    make_plan,
    reaching_max,
    resize_plan,
    resized,
    split_layers,
    with_dp_max,
)
from trainyard.parallel.plan.layout import Gang, Layout, RankCoords
from trainyard.parallel.plan.rules import PlanError

__all__ = ["ClusterResources", "Gang", "Layout", "NodeResources", "Plan", "PlanError", "RankCoords",
           "can_move_in_memory", "make_plan", "reaching_max", "resize_plan", "resized", "split_layers", "with_dp_max"]
