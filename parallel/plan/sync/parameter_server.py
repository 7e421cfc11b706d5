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


ASP_AHEAD = 8
"""Steps the job's loop queues on each rank beyond the one it awaits under ASP: the shards never hold a replica back,
so this queue is all that bounds how far one runs ahead of the slowest (and what a stop waits for)."""


def steps_ahead(consistency: ConsistencyName, staleness: int) -> int:
    """Steps the job's loop (`actors.actions.training`) queues on each rank beyond the one whose answers it awaits:
    one in lockstep (BSP, as every other sync mode: the round trip off the critical path); under SSP the bound, so
    that only the shards' clock holds a fast replica back; ASP_AHEAD under ASP."""
    ahead = bound(consistency, staleness)
    return ASP_AHEAD if ahead is None else max(1, ahead)


def server_event(updates: Sequence[dict], workers: int) -> dict:
    """The job's event of what its shards applied (`ParameterShard.metrics`: step, worker, staleness, version of
    each update): how many, their staleness (the largest, the mean, how many at each), and each worker's count
    (BSP's means, worker -1, are every worker's). Each step's own figures (every replica's staleness and pace) are
    in its metrics row."""
    staleness = [u["staleness"] for u in updates]
    counts: dict[int, int] = {}
    for s in staleness:
        counts[s] = counts.get(s, 0) + 1
    return {"kind": "parameter_server", "updates": len(updates), "max_staleness": max(staleness, default=0),
            "mean_staleness": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness_counts": {str(s): n for s, n in sorted(counts.items())},
            "updates_by_worker": [sum(1 for u in updates if u["worker"] in (w, -1)) for w in range(workers)]}
