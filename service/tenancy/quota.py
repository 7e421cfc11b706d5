"""Per-user resource quotas: the rule, pure. A user's quota (`trainyard token create NAME --max-cpus N --max-gpus
M`) caps the CPUs and GPUs their admitted jobs hold at once.

What a job holds against the quota is its charge (`charge`), not what it asks Ray for: each rank counts at
least one CPU (it runs at least one thread, whatever fraction of a CPU `resources.cpus_per_worker` asks for), and
an elastic job counts its largest size (`parallel.dp.max`), which a submit lowers to what the quota holds
(`replicas_within`), so that growing never takes the user past it.

Two checks read it: at submit, a job that needs more than the whole quota can never run and is refused (a 422 on
`resources`); at admission, a job that would take the user's live jobs over the quota waits in the queue (and
does not hold it: other users' jobs go by), until some of the user's jobs end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trainyard.parallel.config import RuleError
from trainyard.parallel.plan import Gang, Plan
from trainyard.service.errors import JobConflict

RESOURCES = (("CPU", "cpus"), ("GPU", "gpus"))


@dataclass(frozen=True)
class Quota:
    """At most this many CPUs and GPUs held at once by one user's admitted jobs; None: no limit."""

    cpus: float | None = None
    gpus: float | None = None

    def limit(self, resource: str) -> float | None:
        return self.cpus if resource == "CPU" else self.gpus

    def never_fits(self, needed: dict[str, float]) -> str | None:
        """Why a job needing `needed` can never run under this quota (more than all of it), or None."""
        for resource, word in RESOURCES:
            limit = self.limit(resource)
            if limit is not None and needed.get(resource, 0.0) > limit + 1e-9:
                return (f"the job needs {needed[resource]:g} {word} at once, more than the user's quota of {limit:g} "
                        f"{word}; ask an admin for a larger quota, or ask for fewer ranks or resources per worker")
        return None

    def over(self, used: dict[str, float], needed: dict[str, float]) -> str | None:
        """Why a job needing `needed` must wait while the user's live jobs hold `used`, or None if it may start."""
        for resource, word in RESOURCES:
            limit = self.limit(resource)
            held = used.get(resource, 0.0)
            if limit is not None and held + needed.get(resource, 0.0) > limit + 1e-9:
                return (f"the user's quota: their running jobs hold {held:g} of their {limit:g} {word} and this job "
                        f"needs {needed[resource]:g} more")
        return None


NO_QUOTA = Quota()

MIN_CPUS_PER_RANK = 1.0
"""What a rank counts against a CPU quota at least (one thread's core)."""


def charge(plan: Plan, at_dp: int | None = None) -> dict[str, float]:
    """What `plan`'s job holds against a quota (at `at_dp` replicas, if given; else at its size)."""
    ranks = plan.world_size // plan.dp * (at_dp or plan.dp)
    cpus, gpus = plan.gang.bundle["CPU"] / plan.tp, plan.gang.bundle.get("GPU", 0.0) / plan.tp
    return {"CPU": max(cpus, MIN_CPUS_PER_RANK) * ranks, "GPU": gpus * ranks}


def needs(plan: Plan, at_dp: int | None = None) -> dict:
    """What the store keeps of what a job needs: its gang (what admission reserves) and its charge."""
    return {"bundle": dict(plan.gang.bundle), "count": plan.gang.count, "charge": charge(plan, at_dp)}


def charge_of(needs: dict) -> dict[str, float]:
    """A stored job's charge (its `needs`' `charge`; a job stored before charges existed: its gang's resources)."""
    if not needs:
        return {}
    return dict(needs["charge"]) if "charge" in needs else Gang(bundle=needs["bundle"], count=needs["count"]).needed()


def replicas_within(quota: Quota, per_replica: dict[str, float]) -> int | None:
    """The most replicas of `per_replica`'s charge the whole quota holds (None: no limit)."""
    fits = [int(limit / per_replica[resource] + 1e-9) for resource, _ in RESOURCES
            if (limit := quota.limit(resource)) is not None and per_replica.get(resource, 0.0) > 0]
    return min(fits) if fits else None


def usage(live: Iterable[tuple[str, str, dict]], leave_out: str | None = None) -> dict[str, dict[str, float]]:
    """What each user's live jobs hold (their charges), from the store's (job_id, owner, needs) rows
    (`JobStore.live_needs`), but job `leave_out`'s."""
    out: dict[str, dict[str, float]] = {}
    for job_id, owner, needs in live:
        held = out.setdefault(owner, {"CPU": 0.0, "GPU": 0.0})
        needed = charge_of(needs) if job_id != leave_out else {}
        for resource, _ in RESOURCES:
            held[resource] += needed.get(resource, 0.0)
    return out


def check(quota: Quota, needed: dict[str, float], field: str, held: dict[str, float] | None = None) -> None:
    """RuleError on `field` (a 422) when `needed` is more than all of `quota`; with `held` (what the user's other
    live jobs hold), JobConflict (a 409) when it is more than they leave."""
    if (beyond := quota.never_fits(needed)) is not None:
        raise RuleError(field, beyond)
    if held is not None and (over := quota.over(held, needed)) is not None:
        raise JobConflict(over)
