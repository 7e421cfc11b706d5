"""The service's queue policy: which waiting job to admit next, and what a waiting job waits for. Pure.

Waiting jobs are rows in the store (`JobStore.queue()`, priority then submission order); this module
only decides. The order is strict: the head of the queue is admitted when its whole gang (every bundle of
its placement group) fits the free resources, and nothing behind it starts while it does not fit. Without
backfill a large job at the head is never starved by a stream of small ones; backfill needs run-time
estimates that a training service does not have. A job whose layout is not chosen yet (`parallel: auto`
submitted while the node type's costs are measured) is not the head: it cannot be placed, and the wait is
the calibration's, not the cluster's.
"""

from __future__ import annotations

from trainyard.parallel.plan import Gang
from trainyard.service.store import JobRecord


def gang_of(job: JobRecord) -> Gang:
    return Gang(bundle=job.needs["bundle"], count=job.needs["count"])


def planned(job: JobRecord) -> bool:
    """Whether the job's layout is known. A `parallel: auto` job submitted while the node type's costs were being
    measured waits without one (and without holding the queue) until the admission thread plans it."""
    return bool(job.needs)


def next_to_admit(queue: list[JobRecord], free: list[dict[str, float]]) -> JobRecord | None:
    """The head of `queue` (its first planned job) if its whole gang fits the nodes' free resources now, else
    None."""
    head = next((job for job in queue if planned(job)), None)
    if head is None:
        return None
    gang = gang_of(head)
    return head if gang.placeable(free) >= gang.count else None


def waiting_for(position: int, job: JobRecord, free: list[dict[str, float]]) -> dict:
    """What a queued job (1-based `position`) waits for: its resources vs what is free, and why it waits."""
    free_total = {"CPU": sum(n.get("CPU", 0.0) for n in free), "GPU": sum(n.get("GPU", 0.0) for n in free)}
    if not planned(job):
        return {"needed": {}, "free": free_total,
                "reason": "parallel: auto waits for this node type's measured costs (being measured now); its layout "
                          "is chosen when they are known"}
    gang = gang_of(job)
    bundle = ", ".join(f"{v:g} {k}" for k, v in gang.bundle.items())
    if position > 1:
        reason = f"behind {position - 1} earlier job(s) in the queue (priority, then submission order)"
    else:
        room = gang.placeable(free)
        reason = (f"{gang.count} bundle(s) of {{{bundle}}} at once (one per tensor-parallel group); the free "
                  f"resources hold {room} now" if room < gang.count else "being admitted")
    return {"needed": gang.needed(), "free": free_total, "reason": reason}
