"""After a failure, which ranks keep, give or drop state: which live data-parallel replica gives each rank its state
(or none: the job goes back to its checkpoint), which ranks are replaced so that none stays blocked on a dead peer,
and (local_sgd, diloco) which replicas are dropped from the round, the others stepping on. Read by the recovery
(`actors.actions.recovery`, `actors.actions.replica_drop`) and the worker group's tear-down."""

from __future__ import annotations

from collections.abc import Sequence

from trainyard.parallel.plan import Plan, can_move_in_memory
from trainyard.parallel.runtime.step.step_stats import StepReport, StepStats


def replicas_may_recover(plan: Plan) -> bool:
    """Whether a failure may be recovered from a live replica: asked for (fault.from_replica), there are
    replicas, each replica of a (pp, tp) shard holds the whole state (no ZeRO slices, no expert parallelism), and
    the replicas hold the same state (local_sgd and diloco replicas differ between synchronisations; a parameter
    server's hold none: its shards do, and go back to the restore point with the ranks)."""
    return (plan.config.fault.from_replica and plan.dp > 1 and can_move_in_memory(plan, plan)
            and not plan.sync.steps_apart and not plan.sync.server)


def replica_sources(plan: Plan, kept: dict[int, int | None], step: int) -> dict[int, int] | None:
    """For every rank, the global rank whose kept state it takes: the lowest data-parallel replica of its
    (pp, tp) shard whose state holds exactly `step` steps (the step that failed: no step is lost). None when a
    shard has no such replica (all died, or their state is of another step): the job goes back to its
    checkpoint. `kept`: the ranks that kept their state after the failure and the steps it holds."""
    sources = {}
    for rank in range(plan.world_size):
        c = plan.coords(rank)
        live = [d for d in range(plan.dp) if kept.get(plan.rank_of(c.pp, c.tp, d)) == step]
        if not live:
            return None
        sources[rank] = plan.rank_of(c.pp, c.tp, live[0])
    return sources


LATE_STEPS = 2
"""How many steps past the first without a row the ranks may have finished at a failure: the step whose figures
were on their way, and the one queued behind it."""


def live_point(plan: Plan, kept: dict[int, int | None], step: int, answered: dict[int, tuple[StepReport, ...]]
               ) -> tuple[dict[int, int], int] | None:
    """Where a recovery from live replicas goes on: (`replica_sources`, the step), or None. The replicas hold
    the failed step `step` (the first whose row the coordinator lacks); or a later one, when the ranks finished
    the steps between but their figures had not come back (they come one step late, or the rank that died took
    its answer with it), if the ranks' figures of each of those steps (`answered`, by step) say all its row
    needs (a loss, and every stage of one pipeline, any replica's: `telemetry.make_row`)."""
    for resume in range(step, step + LATE_STEPS + 1):
        sources = replica_sources(plan, kept, resume)
        if sources is not None:
            return sources, resume
        stats = [r.stats for r in answered.get(resume, ()) if r.stats is not None]
        if complete_pipeline(stats, plan.pp) is None or not any(s.loss is not None for s in stats):
            return None
    return None


def replicas_to_drop(plan: Plan, dead: set[int], raised: set[int], dropped: dict[int, int]) -> set[int] | None:
    """local_sgd, diloco: the replicas to drop from the round after a failure (those holding a rank that died;
    `parallel.sync` says how they rejoin), or None, and the job recovers as from any failure: no rank died (a
    hang), every replica holds a dead rank, a rank of another replica raised (it was in a sync with the dead
    one, so its state is half-synchronised), a replica is dropped already, or a replica is several dp ranks."""

    if not plan.sync.steps_apart or plan.dp == 1 or not dead or dropped:
        return None
    if plan.reduce_dp > 1:  # replicas of several dp ranks (`parallel.sync.replicas`) are not dropped alone yet
        return None
    broken = {plan.coords(r).dp for r in dead}
    if len(broken) == plan.dp or any(plan.coords(r).dp not in broken for r in raised):
        return None
    return broken


def complete_pipeline(results: Sequence[StepStats], pp: int) -> int | None:
    """The lowest data-parallel replica whose every stage (tensor-parallel rank 0) is among `results` (the ranks'
    figures of a step), or None."""
    stages: dict[int, set[int]] = {}
    for r in results:
        if r.tp_rank == 0:
            stages.setdefault(r.dp_rank, set()).add(r.pp_rank)
    return min((d for d, got in stages.items() if len(got) == pp), default=None)


def replicas_to_replace(plan: Plan, dead: set[int]) -> set[int]:
    """After ranks died, the ranks of every data-parallel replica (pp x tp group) holding a dead one, when some
    replica holds none: they are replaced, not kept. A rank of such a replica may be blocked on its dead peer,
    and the ranks of the whole replicas left may be blocked on it in turn (a data-parallel all-reduce); only a
    process's exit frees them, as it closes its gloo connections (gloo's `abort()` does not interrupt a blocked
    collective, nor does leaving the process groups while their objects live on). Empty when every replica
    holds a dead rank (nothing would be left to take the state from)."""
    broken = {plan.coords(r).dp for r in dead}
    if len(broken) == plan.dp:
        return set()
    return {r for r in range(plan.world_size) if plan.coords(r).dp in broken}
