"""The coordinator's decisions, apart from the state machine that applies them (Ray Train v2's
failure_handling/ and scaling_policy/): each policy is a small object that returns a decision with its
reason, and reads nothing but its arguments, so the tests drive them directly.

- `FailurePolicy`: a failure is recovered from (`RECOVER`, counted against `fault.max_failures`), ridden
  (`RIDE`: an elastic job lost a node; not counted) or ends the job (`RAISE`).
- `HangPolicy`: how long a step may take before it counts as hung.
- `replica_sources`, `live_point`, `replicas_to_replace`: after a failure, which live data-parallel replica
  gives each rank its state (or none: the job goes back to its checkpoint), and which ranks are replaced so
  that none stays blocked on a dead peer.
- `replicas_to_drop`: local_sgd, diloco: the replicas dropped from the round after a failure, the others
  stepping on (or none: the job recovers as from any failure).
- `FixedScaling` / `ElasticScaling`: whether to resize, from what is free in the cluster.
- `ResizeDesk`: the one place a resize is decided, whoever asks (a `scale` request, the elastic grower): a
  request claims the desk before it waits for resources and is refused while another holds it, so two
  requests can never overwrite each other, and a claim taken while the job was RUNNING is checked again
  when its resources are ready.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from trainyard.parallel.config import FaultConfig
from trainyard.parallel.plan import Plan, PlanError, can_move_in_memory, make_plan, resized
from trainyard.parallel.plan.replica_sync import is_local

log = logging.getLogger("trainyard.coordinator")

HANG_WINDOW = 20
HANG_MIN_STEPS = 3
"""Steps recorded before the hang detector trusts their median (the first steps include warm-up)."""


class FailureAction(StrEnum):
    RECOVER = "recover"
    RIDE = "ride"
    RAISE = "raise"


@dataclass(frozen=True)
class FailureDecision:
    action: FailureAction
    reason: str


@dataclass(frozen=True)
class FailurePolicy:
    max_failures: int
    elastic: bool

    def decide(self, counted_before: int, *, node_lost: bool, stopping: bool,
               out_of_memory: bool = False) -> FailureDecision:
        """What to do about a failure, given the failures already counted. A failure while recovering or
        resizing is one like any other: it counts, and the job goes on while the budget allows. A rank that ran
        out of memory would again at the same layout and step: that ends the job, whatever the budget."""
        if self.elastic and node_lost and not stopping:
            return FailureDecision(FailureAction.RIDE, "an elastic job lost a node: ride it (not counted)")
        if stopping:
            return FailureDecision(FailureAction.RAISE, "the job was stopping")
        if out_of_memory:
            return FailureDecision(FailureAction.RAISE, "a rank ran out of memory: the same layout would again")
        if counted_before + 1 > self.max_failures:
            return FailureDecision(FailureAction.RAISE, f"failure {counted_before + 1} is more than "
                                                        f"fault.max_failures={self.max_failures}")
        return FailureDecision(FailureAction.RECOVER, f"failure {counted_before + 1} of "
                                                      f"fault.max_failures={self.max_failures}")


@dataclass(frozen=True)
class HangPolicy:
    fault: FaultConfig

    def deadline(self, recent_step_times: list[float]) -> float:
        """How long a step may take before it counts as hung: hang_factor x the median of the recent steps
        (with a floor), once there are a few; never more than step_timeout_s."""
        recent = sorted(recent_step_times[-HANG_WINDOW:])
        if len(recent) < HANG_MIN_STEPS:
            return self.fault.step_timeout_s
        median = recent[len(recent) // 2]
        return min(self.fault.step_timeout_s, max(self.fault.hang_floor_s, self.fault.hang_factor * median))


def replicas_may_recover(plan: Plan) -> bool:
    """Whether a failure may be recovered from a live replica: asked for (fault.from_replica), there are
    replicas, each replica of a (pp, tp) shard holds the whole state (no ZeRO slices, no expert parallelism), and
    the replicas hold the same state (local_sgd and diloco replicas differ between synchronisations)."""
    return (plan.config.fault.from_replica and plan.dp > 1 and can_move_in_memory(plan, plan)
            and not is_local(plan.parallel.sync))


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


def live_point(plan: Plan, kept: dict[int, int | None], step: int, answered: dict[int, tuple[dict, ...]]
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
        rows = answered.get(resume, ())
        if complete_pipeline(rows, plan.pp) is None or not any(r["loss"] is not None for r in rows):
            return None
    return None


def replicas_to_drop(plan: Plan, dead: set[int], raised: set[int], dropped: dict[int, int]) -> set[int] | None:
    """local_sgd, diloco: the replicas to drop from the round after a failure (those holding a rank that died;
    `parallel.sync` says how they rejoin), or None, and the job recovers as from any failure: no rank died (a
    hang), every replica holds a dead rank, a rank of another replica raised (it was in a sync with the dead
    one, so its state is half-synchronised), a replica is dropped already, or a replica is several dp ranks."""

    if not is_local(plan.parallel.sync) or plan.dp == 1 or not dead or dropped:
        return None
    if plan.reduce_dp > 1:  # replicas of several dp ranks (`parallel.sync.replicas`) are not dropped alone yet
        return None
    broken = {plan.coords(r).dp for r in dead}
    if len(broken) == plan.dp or any(plan.coords(r).dp not in broken for r in raised):
        return None
    return broken


def complete_pipeline(results: tuple[dict, ...] | list[dict], pp: int) -> int | None:
    """The lowest data-parallel replica whose every stage (tensor-parallel rank 0) is among `results` (a step's
    answers), or None."""
    stages: dict[int, set[int]] = {}
    for r in results:
        if r["tp_rank"] == 0:
            stages.setdefault(r["dp_rank"], set()).add(r["pp_rank"])
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


@dataclass(frozen=True)
class NoopDecision:
    reason: str = ""


@dataclass(frozen=True)
class ResizeDecision:
    dp: int
    reason: str


def largest_size(plan: Plan, at_most: int) -> int | None:
    """The largest data-parallel size <= at_most within the job's range that every plan rule allows."""
    assert plan.dp_range is not None, "an elastic job's"
    low, high = plan.dp_range
    for size in range(min(at_most, high), low - 1, -1):
        try:
            make_plan(resized(plan.config, size))  # every rule, e.g. ep must divide dp
            return size
        except PlanError:
            continue
    return None


class FixedScaling:
    """A job with a fixed parallel.dp never resizes by itself."""

    def decide(self, plan: Plan, free_groups: int) -> NoopDecision | ResizeDecision:
        return NoopDecision("fixed size")


class ElasticScaling:
    """parallel.dp = {min, max}: grow into the groups that are free (bundles of a lost node Ray placed again
    count too), to the largest size the rules allow."""

    def decide(self, plan: Plan, free_groups: int) -> NoopDecision | ResizeDecision:
        size = largest_size(plan, plan.dp + free_groups // plan.pp)
        if size is not None and size > plan.dp:
            return ResizeDecision(size, "resources appeared")
        return NoopDecision(f"no room to grow past dp={plan.dp}")


def failure_policy(plan: Plan) -> FailurePolicy:
    """The job's failure policy, from its spec (`fault.max_failures`) and whether it is elastic."""
    return FailurePolicy(plan.config.fault.max_failures, elastic=plan.dp_range is not None)


def scaling_policy(plan: Plan) -> FixedScaling | ElasticScaling:
    return ElasticScaling() if plan.dp_range is not None else FixedScaling()


@dataclass(frozen=True)
class Resize:
    """A resize the desk accepted: the new plan, why, and when it was asked for."""

    plan: Plan
    reason: str
    asked: float


class ResizeDesk:
    """Where resizes are decided: at most one is claimed or ready at a time.

    `request` claims the desk synchronously (no await between the check and the claim, so two coroutines of
    the actor's event loop cannot both pass it), then awaits the resources, then checks the job again."""

    def __init__(self) -> None:
        self.claimed_by: str | None = None
        self.ready: Resize | None = None
        """The resize the controller takes at the next step boundary."""

    def take(self) -> Resize | None:
        resize, self.ready = self.ready, None
        return resize

    async def request(self, new: Plan, reason: str, asked: float, running: Callable[[], bool],
                      current: Callable[[], Plan], reserve: Callable[[], Awaitable[str | None]]) -> str | None:
        """Accept a resize to `new` (None) or say why not. `running`: whether the job can be resized now;
        `current`: the job's plan now; `reserve`: reserves the added ranks' resources, or says why it cannot."""
        if not running() or self.claimed_by is not None or self.ready is not None:
            busy = self.claimed_by or (self.ready.reason if self.ready else None)
            return f"resizing already ({busy})" if busy else "not running"
        self.claimed_by, before = reason, current()
        try:
            problem = await reserve()
            if problem:
                return problem
            if not running() or current() is not before:
                return "the job changed while the resources were reserved (a failure or a resize); ask again"
            self.ready = Resize(new, reason, asked)
            log.info("resize to dp=%d accepted (%s)", new.dp, reason)
            return None
        finally:
            self.claimed_by = None
