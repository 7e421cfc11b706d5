"""Data-parallel sharding strategies: how the ranks that reduce one set of gradients share its state.

A registry keyed by the spec's `parallel.zero`: 0 keeps everything on every rank (all-reduce), 1 is ZeRO-1
(each rank keeps the reduced gradients and the optimizer state of its 1/N slice: reduce-scatter, then an
all-gather of the parameters after the step). ZeRO-2 and ZeRO-3 slot in as new entries. Each strategy
answers the questions the rest of the code asks of it: the memory plan its gradient and optimizer-state
elements per rank (`parallel.memory`), the gradient reducer whether to shard (`parallel.data_parallel`),
a resize whether the state may stay in memory (`parallel.plan.can_move_in_memory`). Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    """Strategy 0: every rank of the group holds every gradient and all of the optimizer's state."""

    zero: int = 0
    shards_optimizer_state: bool = False
    """Each rank keeps the reduced gradients and the optimizer state of its 1/N slice of every bucket only
    (reduce-scatter instead of all-reduce; the parameters are all-gathered after the step)."""

    def gradient_elements(self, n: int, group_size: int) -> int:
        """Gradient elements a rank holds for `n` local parameters reduced over `group_size` ranks: the fp32
        buckets hold every local gradient."""
        return n

    def optimizer_elements(self, n: int, group_size: int) -> int:
        """Parameter elements whose optimizer state a rank keeps, of `n` reduced over `group_size` ranks."""
        return n

    @property
    def replicas_identical(self) -> bool:
        """Every rank of a group holds the same parameters and optimizer state (so a resize that only
        changes dp can keep the state in the surviving ranks' memory)."""
        return not self.shards_optimizer_state


@dataclass(frozen=True)
class OptimizerStateSharding(Sharding):
    """ZeRO-1: the whole gradient buckets stay (autograd accumulates into them) and the reduced 1/N slice is
    added; the optimizer's state exists for the slice only."""

    zero: int = 1
    shards_optimizer_state: bool = True

    def gradient_elements(self, n: int, group_size: int) -> int:
        return n + (math.ceil(n / group_size) if group_size > 1 else 0)

    def optimizer_elements(self, n: int, group_size: int) -> int:
        return math.ceil(n / group_size)


SHARDINGS: dict[int, Sharding] = {0: Sharding(), 1: OptimizerStateSharding()}
"""`parallel.zero` -> its strategy."""


def sharding_for(zero: int) -> Sharding:
    try:
        return SHARDINGS[zero]
    except KeyError:
        raise ValueError(f"no data-parallel sharding strategy for parallel.zero={zero!r}; "
                         f"known: {sorted(SHARDINGS)}") from None
