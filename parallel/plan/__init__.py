"""The plan room: everything decided before a rank starts, in pure Python (no torch).

Owns the layout (`layout`), the rules between fields (`rules`), admission (`admission`), the ZeRO strategies
(`sharding`), the replica sync modes' and the gradient compressors' pure facts (`replica_sync`, `grad_compression`),
which ranks reduce which gradients (`reduction_sets`) and the bytes they send (`reduction_bytes`), and the plan as
data for the API (`present`); and, in rooms of their own, pipeline schedules in their action vocabulary and their
simulator (`schedule/`), the memory plan (`memory/`) and the automatic planner with its cost model and
calibration's fits and cache (`planner/`; the measuring run is `parallel.runtime.calibrate`). `make_plan(config,
cluster)` (in `job_plan`) returns the frozen `Plan` every other room reads, each strategy its config names resolved
once (`sizing`: `plan.parallel`, `plan.sharding`, `plan.schedule`, `plan.optimizer`, `plan.family`, `plan.sync`,
`plan.compression`). May import `parallel.config`, `parallel.names`, `parallel.seeds`, `parallel.models` (its
registry and counting) and `parallel.optim.kinds` (the optimizer registry); never torch, `runtime`, `data` or `io`.
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
