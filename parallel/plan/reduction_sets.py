"""Which ranks sum which gradients: the reduction sets, decided here once for the runtime and the plan alike.

A parameter is in one set, by its name (`ModelFamily.reduction_set`; the family's counts split the same way:
`ParamCounts.dense`, `.router`, `.experts`, and each matrix of `ModelFamily.matrices` names its set), and only a
parameter that gets a gradient is reduced (with `model.lora`, the adapters: dense). Each set's gradients are summed
over the ranks that computed parts of them (`parallel.models.components.moe`):

- `dense`: the data-parallel ranks of one replica with their context-parallel ranks (`Layout.dp_groups`: every dp
  rank, or one local_sgd / diloco replica's, `parallel.sync.replicas`; each times cp, whose ranks each hold a share
  of the sequences' gradient);
- `router`: every rank of the replica's pipeline stage, dp x tp (`Layout.stage_groups`);
- `experts`: the ranks holding the same experts, dp / ep x tp (`Layout.expert_groups`).

The runtime reduces each set over its group (`parallel.runtime.distributed.RankGroups.reducing`, this rank's of
`reduction_groups`); the memory plan shards the gradients and the optimizer state over them (`reduced_sets`) and
the reduction bytes count what a rank sends for the sets it shares (`shared_sets`, `parallel.plan.reduction_bytes`).
Pure: no torch.
"""

from __future__ import annotations

from typing import get_args

from trainyard.parallel.models.base import ReductionSet
from trainyard.parallel.models.counting import ParamCounts
from trainyard.parallel.plan.layout import Layout

REDUCTION_SETS: tuple[ReductionSet, ...] = get_args(ReductionSet)


def reduction_groups(layout: Layout) -> dict[ReductionSet, list[list[int]]]:
    """Each set -> the groups of ranks that sum its gradients (every rank is in one group of each)."""
    return {"dense": layout.dp_groups(), "router": layout.stage_groups(), "experts": layout.expert_groups()}


def group_sizes(layout: Layout) -> dict[ReductionSet, int]:
    """Each set -> the size of its groups (`reduction_groups`'), by arithmetic: the planner asks it of layouts far
    too large to list the groups of."""
    dp = layout.reduce_dp
    return {"dense": dp * layout.cp, "router": dp * layout.tp, "experts": dp // layout.ep * layout.tp}


def shared_sets(layout: Layout) -> set[ReductionSet]:
    """The sets whose gradients other ranks share: the ones a rank sends anything for."""
    return {s for s, size in group_sizes(layout).items() if size > 1}


def reduced_sets(layout: Layout, counts: ParamCounts) -> list[tuple[int, int]]:
    """(local parameters, ranks that reduce their gradients) of each set, from a rank's counts by set."""
    sizes = group_sizes(layout)
    return [(counts.dense, sizes["dense"]), (counts.router, sizes["router"]), (counts.experts, sizes["experts"])]
