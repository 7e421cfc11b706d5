"""Data-parallel sharding strategies: how the ranks that reduce one set of gradients share its state.

A registry keyed by the spec's `parallel.zero`: 0 keeps everything on every rank (all-reduce), 1 is ZeRO-1 (each rank
keeps the reduced gradients and the optimizer state of its 1/N slice: reduce-scatter, then an all-gather of the
parameters after the step), 2 is ZeRO-2 (the reduced gradients exist as this rank's 1/N shard only) and 3 is ZeRO-3 (the
parameters too, gathered one block at a time around its forward and backward); 2 and 3 are torch's FSDP2
(`parallel.runtime.dp.fsdp`). Each strategy answers the questions the rest of the code asks of it: the memory plan its
parameter, gradient and optimizer-state elements per rank (`parallel.plan.memory.estimate`), the gradient reducer
whether to shard (`parallel.runtime.dp.data_parallel`), the trainer whether to hand the chunks to FSDP2 and how, a
resize whether the state may stay in memory (`parallel.plan.can_move_in_memory`), the cost model which collectives a
step runs (`parallel.plan.planner.cost_model`). Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from trainyard.parallel.names import ZERO_LEVELS, registry

Pass = list[tuple[Hashable, int]]
"""One compute (a forward or a backward of a chunk): the FSDP2 units it runs, in order, each with its local
parameter elements that are sharded; a unit that runs twice in it is listed twice. The computes of one chunk and
direction repeat over the micro-batches: the caller passes the same list for each."""


@dataclass(frozen=True)
class Sharding:
    """Strategy 0: every rank of the group holds every gradient and all of the optimizer's state."""

    zero: int = 0
    shards_optimizer_state: bool = False
    """Each rank keeps the reduced gradients and the optimizer state of its 1/N slice of every bucket only
    (reduce-scatter instead of all-reduce; the parameters are all-gathered after the step)."""

    shards_parameters: bool = False
    """The parameters (and so gradients and optimizer state) are stored as this rank's 1/N shard, by FSDP2."""
    reshard_after_forward: bool = True
    """With `shards_parameters`: a chunk's gathered parameters are freed after each forward and backward
    (ZeRO-3), or kept from its first forward of the step to its last backward (ZeRO-2)."""
    gradient_collective: str = "allreduce"
    """How the group sums the gradients: `allreduce` (every rank gets the whole sum) or `reducescatter` (each
    its 1/N slice)."""
    reduces_every_microbatch: bool = False
    """The gradients are summed after each micro-batch's backward (FSDP2 adds them into the shard), not once at
    the step's end."""

    def gathers_per_step(self, microbatches: int) -> int:
        """All-gathers of the rank's whole parameters a step runs (0: nothing is gathered)."""
        return 0

    def param_elements(self, n: int, group_size: int) -> int:
        """Parameter elements a rank keeps between steps, of `n` local ones sharded over `group_size` ranks."""
        return n

    def gathered_elements(self, passes: list[Pass]) -> int:
        """Parameter elements gathered whole at the step's peak, besides `param_elements`, given the rank's
        computes in the schedule's order, each the FSDP2 units it runs in order with their local elements that
        are sharded (0: nothing is gathered)."""
        return 0

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
    gradient_collective: str = "reducescatter"

    def gathers_per_step(self, microbatches: int) -> int:
        return 1  # after the optimizer step

    def gradient_elements(self, n: int, group_size: int) -> int:
        return n + (math.ceil(n / group_size) if group_size > 1 else 0)

    def optimizer_elements(self, n: int, group_size: int) -> int:
        return math.ceil(n / group_size)


@dataclass(frozen=True)
class GradientSharding(Sharding):
    """ZeRO-2 (FSDP2 with `reshard_after_forward=False`): each rank keeps the 1/N shard of the parameters,
    their reduced gradients and optimizer state between steps. A chunk's parameters are gathered at its
    first forward of the step and kept whole until its last backward, so during the step every chunk is
    held whole beside its shard; each micro-batch's backward reduce-scatters each block's gradients into the
    shard as soon as that block's backward is done (DeepSpeed stage 2's accumulation, per FSDP2 unit: the
    embedding, a block, the head), so no whole gradient outlives the backward of the block that made it."""

    zero: int = 2
    shards_optimizer_state: bool = True
    shards_parameters: bool = True
    reshard_after_forward: bool = False
    gradient_collective: str = "reducescatter"
    reduces_every_microbatch: bool = True

    def gathers_per_step(self, microbatches: int) -> int:
        return 1  # each chunk before its first forward of the step

    def param_elements(self, n: int, group_size: int) -> int:
        return _shard(n, group_size)

    def gathered_elements(self, passes: list[Pass]) -> int:
        return sum({unit: n for units in passes for unit, n in units}.values())  # every unit, whole all step

    def gradient_elements(self, n: int, group_size: int) -> int:
        return _shard(n, group_size)

    def optimizer_elements(self, n: int, group_size: int) -> int:
        return _shard(n, group_size)


@dataclass(frozen=True)
class ParameterSharding(GradientSharding):
    """ZeRO-3 (FSDP2 with `reshard_after_forward=True`), per block: as ZeRO-2, but each unit of a chunk (the
    embedding, a block, the head) is gathered just before each of its forwards and backwards and freed after;
    the next unit's gather (in the same compute or the next one) is started while this one computes, so at the
    peak one unit is whole and the next one's gather is in flight."""

    zero: int = 3
    reshard_after_forward: bool = True

    def gathers_per_step(self, microbatches: int) -> int:
        return 2 * microbatches  # each unit of each chunk before each of its forwards and backwards

    def gathered_elements(self, passes: list[Pass]) -> int:
        peak, inner = 0, {}
        for i, units in enumerate(passes):
            if id(units) not in inner:  # a compute that repeats another is the same list: walked once
                inner[id(units)] = _pass_peak(units)
                peak = max(peak, inner[id(units)])
            if units and i + 1 < len(passes) and passes[i + 1]:  # the last unit and the next compute's first
                (last, n), (first, m) = units[-1], passes[i + 1][0]
                peak = max(peak, n if last == first else n + m)
        return peak


def _pass_peak(units: Pass) -> int:
    """The most one compute holds gathered at once: the unit computing, the next one's gather, and a unit that
    runs twice in it (tied embeddings: the embedding and the head), which FSDP2 frees only after its second run."""
    first: dict[Hashable, int] = {}
    last: dict[Hashable, int] = {}
    for k, (unit, _) in enumerate(units):
        first.setdefault(unit, k)
        last[unit] = k
    sizes, twice = dict(units), [u for u in first if last[u] > first[u]]
    peak = 0
    for k, (unit, _) in enumerate(units):
        following = [units[k + 1][0]] if k + 1 < len(units) else []
        held = {unit, *following, *(u for u in twice if first[u] < k < last[u])}
        peak = max(peak, sum(sizes[u] for u in held))
    return peak


def _shard(n: int, group_size: int) -> int:
    return math.ceil(n / group_size) if group_size > 1 else n


SHARDINGS: dict[int, Sharding] = registry(ZERO_LEVELS, {s.zero: s for s in (
    Sharding(), OptimizerStateSharding(), GradientSharding(), ParameterSharding())}, "parallel.plan.sharding.SHARDINGS")
"""`parallel.zero` -> its strategy (the levels: `parallel.names.ZeroLevel`)."""


def sharding_for(zero: int) -> Sharding:
    try:
        return SHARDINGS[zero]
    except KeyError:
        raise ValueError(f"no data-parallel sharding strategy for parallel.zero={zero!r}; "
                         f"known: {sorted(SHARDINGS)}") from None
