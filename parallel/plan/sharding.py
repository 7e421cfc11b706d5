"""Data-parallel sharding strategies: how the ranks that reduce one set of gradients share its state.

A registry keyed by the spec's `parallel.zero`: 0 keeps everything on every rank (all-reduce), 1 is ZeRO-1
(each rank keeps the reduced gradients and the optimizer state of its 1/N slice: reduce-scatter, then an
all-gather of the parameters after the step), 2 is ZeRO-2 (the reduced gradients exist as this rank's 1/N
shard only) and 3 is ZeRO-3 (the parameters too, gathered per pipeline chunk around its forward and
backward); 2 and 3 are torch's FSDP2 (`parallel.runtime.fsdp`). Each strategy answers the questions the rest of the
code asks of it: the memory plan its parameter, gradient and optimizer-state elements per rank
(`parallel.plan.memory`), the gradient reducer whether to shard (`parallel.runtime.data_parallel`), the trainer whether
to hand the chunks to FSDP2 and how, a resize whether the state may stay in memory
(`parallel.plan.can_move_in_memory`), the cost model which collectives a step runs (`parallel.plan.cost_model`).
Pure: no torch.
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

    def gathered_elements(self, chunks: list[int]) -> int:
        """Parameter elements gathered whole at the step's peak, besides `param_elements`, given the local
        elements of each of the rank's chunks that are sharded (0: nothing is gathered)."""
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
    held whole beside its shard; each micro-batch's backward reduce-scatters the chunk's gradients into the
    shard (DeepSpeed stage 2's accumulation), so no whole gradient outlives the backward that made it."""

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

    def gathered_elements(self, chunks: list[int]) -> int:
        return sum(chunks)

    def gradient_elements(self, n: int, group_size: int) -> int:
        return _shard(n, group_size)

    def optimizer_elements(self, n: int, group_size: int) -> int:
        return _shard(n, group_size)


@dataclass(frozen=True)
class ParameterSharding(GradientSharding):
    """ZeRO-3 (FSDP2 with `reshard_after_forward=True`): as ZeRO-2, but a chunk's parameters are gathered
    just before each of its forwards and backwards and freed after; the next chunk's gather is started while
    this one computes, so at the peak one chunk is whole and the next one's gather is in flight."""

    zero: int = 3
    reshard_after_forward: bool = True

    def gathers_per_step(self, microbatches: int) -> int:
        return 2 * microbatches  # each chunk before each of its forwards and backwards

    def gathered_elements(self, chunks: list[int]) -> int:
        return sum(sorted(chunks)[-2:])  # the largest chunk computing while the next largest is gathered


def _shard(n: int, group_size: int) -> int:
    return math.ceil(n / group_size) if group_size > 1 else n


SHARDINGS: dict[int, Sharding] = {0: Sharding(), 1: OptimizerStateSharding(), 2: GradientSharding(),
                                  3: ParameterSharding()}
"""`parallel.zero` -> its strategy."""


def sharding_for(zero: int) -> Sharding:
    try:
        return SHARDINGS[zero]
    except KeyError:
        raise ValueError(f"no data-parallel sharding strategy for parallel.zero={zero!r}; "
                         f"known: {sorted(SHARDINGS)}") from None
