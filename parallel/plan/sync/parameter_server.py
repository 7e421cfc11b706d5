"""A parameter server's pure rules (`parallel.sync: {kind: parameter_server, consistency, staleness, shards}`): who
may start which step (the BSP / SSP / ASP clock), the staleness an update carried, how the server applies the
pushes of a step, and which shard owns which parameter. The shards (`actors.ps_shard`) and the rank's client
(`parallel.runtime.sync.parameter_server`) ask these; tests/unit/test_parameter_server.py checks them without
processes.

The clock is a worker's count of finished steps (a step is finished once its gradients are applied on every
shard). With `staleness` s, SSP (Ho et al. 2013) lets a worker start step t only once every worker has finished step
t - 1 - s, i.e. the slowest worker's count is at least t - s; BSP is SSP at s = 0 (lockstep); ASP never waits.

What the server does with a step's pushes: BSP keeps them until every worker has pushed that step and applies their
mean once (so it is all-reduce data parallelism, for every optimizer kind); SSP and ASP apply each push as it
arrives, scaled by 1 / workers (so with plain SGD the pushes of one step add up to one mean step: SSP at s = 0
is then BSP exactly).

Pure: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainyard.parallel.names import CONSISTENCY_NAMES, ConsistencyName, registry


@dataclass(frozen=True)
class Consistency:
    """What one consistency model (`parallel.sync.consistency`) means for the clock and the server."""

    waits: bool
    """A worker may wait before a step (BSP, SSP); False: it never does (ASP)."""
    fixed_bound: int | None
    """Steps a worker may run ahead of the slowest whatever `staleness` says (BSP: 0); None: `staleness` (SSP), or
    no bound (ASP, whose `waits` is False)."""
    applies_mean: bool
    """The server applies the mean of a step's pushes once every worker pushed it (BSP); False: each push as it
    arrives, scaled by 1 / workers."""


CONSISTENCIES: dict[ConsistencyName, Consistency] = registry(CONSISTENCY_NAMES, {
    "bsp": Consistency(waits=True, fixed_bound=0, applies_mean=True),
    "asp": Consistency(waits=False, fixed_bound=None, applies_mean=False),
    "ssp": Consistency(waits=True, fixed_bound=None, applies_mean=False),
}, "the parameter server's consistency models")


def bound(consistency: ConsistencyName, staleness: int) -> int | None:
    """Steps a worker may run ahead of the slowest (None: unbounded)."""
    kind = CONSISTENCIES[consistency]
    if not kind.waits:
        return None
    return kind.fixed_bound if kind.fixed_bound is not None else staleness


def may_start(step: int, finished: Sequence[int], consistency: ConsistencyName, staleness: int = 0) -> bool:
    """Whether a worker may start step `step` (0-based) when the workers have finished `finished` steps each: under
    SSP every worker must have finished step `step - 1 - s` (the slowest's count at least `step - s`)."""
    ahead = bound(consistency, staleness)
    return ahead is None or min(finished) >= step - ahead


def staleness_of(step: int, finished: Sequence[int]) -> int:
    """The staleness an update for `step` carries when its worker started it with the workers' counts `finished`:
    the steps of the slowest worker's updates missing from the parameters it computed on (0 in lockstep; at most
    s under SSP)."""
    return max(0, step - min(finished))


def assign_shards(sizes: Sequence[int], shards: int) -> list[int]:
    """The shard owning each parameter (by element count `sizes`, in order): the largest first, each to the least
    loaded shard (ties: the lowest), so the shards' loads differ by at most the largest parameter. Deterministic,
    so every worker and every shard computes the same map."""
    load = [0] * shards
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(shards), key=lambda s: (load[s], s))
        owner[i] = target
        load[target] += sizes[i]
    return owner


def push_weight(consistency: ConsistencyName, workers: int) -> float:
    """The scale of one push's gradient in the update it makes: 1 / workers for SSP and ASP, which apply each push
    alone; BSP applies the mean of the step's pushes (1, after averaging)."""
    return 1.0 if CONSISTENCIES[consistency].applies_mean else 1.0 / workers
