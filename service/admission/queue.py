"""The service's queue policy: which waiting job to admit next, and what a waiting job waits for. Pure.

Waiting jobs are rows in the store (`JobStore.queue()`, priority then submission order); this module
only decides. The order (`fair_order`): higher priority first; at equal priority the users take turns (fair
share): a user's n-th waiting job comes after every other user's (n-1)-th, counting the jobs each user already
runs, so one user's burst of submits does not hold the cluster; then submission order. A job its owner's quota
(`service.tenancy.quota`) holds back waits without holding the queue. Then the order is strict: the head of the queue
is admitted when its whole gang (every bundle of its placement group) fits the free resources, and nothing behind
it starts while it does not fit. Without
backfill a large job at the head is never starved by a stream of small ones; backfill needs run-time
estimates that a training service does not have. A job whose layout is not chosen yet (`parallel: auto`
submitted while the node type's costs are measured) is not the head: it cannot be placed, and the wait is
the calibration's, not the cluster's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from trainyard.parallel.plan import Gang
from trainyard.service.store import JobRecord
from trainyard.service.tenancy.quota import NO_QUOTA, Quota, charge_of

Quotas = Callable[[str], Quota]
"""A user's quota by name."""


def gang_of(job: JobRecord) -> Gang:
    return Gang(bundle=job.needs["bundle"], count=job.needs["count"])


def planned(job: JobRecord) -> bool:
    """Whether the job's layout is known. A `parallel: auto` job submitted while the node type's costs were being
    measured waits without one (and without holding the queue) until the admission thread plans it."""
    return bool(job.needs)


def fair_order(waiting: list[JobRecord], running: Mapping[str, int]) -> list[JobRecord]:
    """`waiting` (priority then submission order, as the store gives it) in admission order: by priority, then
    turns (a job's turn is how many jobs its owner runs, `running`, plus how many of theirs wait before it at its
    priority), then submission."""
    turns: dict[tuple[int, str], int] = {}
    keyed = []
    for index, job in enumerate(waiting):
        slot = (job.priority, job.owner)
        turn = turns.get(slot, running.get(job.owner, 0))
        turns[slot] = turn + 1
        keyed.append(((-job.priority, turn, index), job))
    return [job for _, job in sorted(keyed, key=lambda pair: pair[0])]


def held_by_quota(job: JobRecord, held: Mapping[str, dict[str, float]], quotas: Quotas) -> str | None:
    """Why the job's owner's quota holds it back while their live jobs hold `held[owner]`, or None."""
    if not planned(job):
        return None
    reason = quotas(job.owner).over(held.get(job.owner, {}), charge_of(job.needs))
    return None if reason is None else f"{reason}; it starts when some of their jobs end"


def next_to_admit(queue: list[JobRecord], free: list[dict[str, float]], held: Mapping[str, dict[str, float]] = {},
                  quotas: Quotas = lambda _: NO_QUOTA) -> JobRecord | None:
    """The head of `queue` (its first planned job its owner's quota lets start) if its whole gang fits the nodes'
    free resources now, else None."""
    head = next((job for job in queue if planned(job) and held_by_quota(job, held, quotas) is None), None)
    if head is None:
        return None
    gang = gang_of(head)
    return head if gang.placeable(free) >= gang.count else None


def view(queue: list[JobRecord], free: list[dict[str, float]], held: Mapping[str, dict[str, float]] = {},
         quotas: Quotas = lambda _: NO_QUOTA) -> dict[str, tuple[int, dict]]:
    """job_id -> (position from 1 in `queue`, what it waits for) for each job of `queue` (in admission order)."""
    out, ahead = {}, 0
    for position, job in enumerate(queue, start=1):
        quota_reason = held_by_quota(job, held, quotas)
        out[job.job_id] = (position, waiting_for(ahead + 1, job, free, quota_reason))
        ahead += planned(job) and quota_reason is None
    return out


def waiting_for(position: int, job: JobRecord, free: list[dict[str, float]], quota_reason: str | None = None) -> dict:
    """What a queued job waits for: its resources vs what is free, and why it waits (`position`: 1 if no job that
    may start is ahead of it; `quota_reason`: its owner's quota holds it back, see `held_by_quota`)."""
    free_total = {"CPU": sum(n.get("CPU", 0.0) for n in free), "GPU": sum(n.get("GPU", 0.0) for n in free)}
    if not planned(job):
        return {"needed": {}, "free": free_total,
                "reason": "parallel: auto waits for this node type's measured costs (being measured now); its layout "
                          "is chosen when they are known"}
    gang = gang_of(job)
    bundle = ", ".join(f"{v:g} {k}" for k, v in gang.bundle.items())
    if quota_reason is not None:
        reason = quota_reason
    elif position > 1:
        reason = f"behind {position - 1} earlier job(s) in the queue (priority, then users in turn, then submission)"
    else:
        room = gang.placeable(free)
        reason = (f"{gang.count} bundle(s) of {{{bundle}}} at once (one per tensor-parallel group); the free "
                  f"resources hold {room} now" if room < gang.count else "being admitted")
    return {"needed": gang.needed(), "free": free_total, "reason": reason}
