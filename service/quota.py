"""Per-user resource quotas: the rule, pure. A user's quota (`trainyard token create NAME --max-cpus N --max-gpus
M`) caps the CPUs and GPUs their admitted jobs hold at once.

Two checks read it: at submit, a job that needs more than the whole quota can never run and is refused (a 422 on
`resources`); at admission, a job that would take the user's live jobs over the quota waits in the queue (and
does not hold it: other users' jobs go by), until some of the user's jobs end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trainyard.parallel.config import RuleError
from trainyard.parallel.plan import Gang
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


def usage(live: Iterable[tuple[str, str, dict]], leave_out: str | None = None) -> dict[str, dict[str, float]]:
    """What each user's live jobs hold, from the store's (job_id, owner, needs) rows (`JobStore.live_needs`), but
    job `leave_out`'s."""
    out: dict[str, dict[str, float]] = {}
    for job_id, owner, needs in live:
        held = out.setdefault(owner, {"CPU": 0.0, "GPU": 0.0})
        needed = Gang(**needs).needed() if needs and job_id != leave_out else {}
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
