"""The jobs this service follows in Ray, and the follower that polls them.

`LiveJobs` holds, for every admitted job, its coordinator, its placement group, the poll in flight and how far
the store has read its reports (`service.following.follow.Cursor`), behind one lock that the API's threads, the
admission thread and the follower thread share. It writes a report to the store (`apply`), ends a job
(`finish`: the store first, then what it holds in Ray is released) and polls every coordinator without waiting
on any one of them (`follow`). One job's failure never stops a thread: `guarded` fails that job instead, with a
sentence naming the service's error (`handling_failed`); its traceback goes to the service's log, not to the job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from trainyard.actors.calls import first_line
from trainyard.actors.state import JobStatus
from trainyard.actors.worker_group.worker_group import remove_grown_placement_groups
from trainyard.service.following.follow import Cursor, apply_report
from trainyard.service.store import JobStore

log = logging.getLogger("trainyard.manager")


def coordinator_lost(error: Exception) -> tuple[JobStatus, str | None]:
    """What a poll that Ray answered with `error` means for the job: RECOVERING while Ray restarts its coordinator
    (within `fault.max_failures`), else FAILED with a sentence saying why (never the service's own traceback)."""
    if isinstance(error, ray.exceptions.ActorUnavailableError):  # its process died and Ray is starting it again
        return JobStatus.RECOVERING, None
    first = first_line(error)
    if isinstance(error, ray.exceptions.OutOfMemoryError) or "running low on memory" in str(error):
        return JobStatus.FAILED, (f"the job's coordinator was killed: its node ran out of memory (Ray's memory "
                                  f"monitor): {first}")
    if isinstance(error, ray.exceptions.RayActorError):  # its text may hold the traceback of its __init__
        return JobStatus.FAILED, f"the job's coordinator died: {first}"
    if isinstance(error, ray.exceptions.RayTaskError):  # its own code raised answering the poll
        cause = error.cause if isinstance(error.cause, BaseException) else error
        return JobStatus.FAILED, (f"the job's coordinator failed answering the service (an error in trainyard, not "
                                  f"in a rank): {type(cause).__name__}: {first_line(cause)} (the traceback is in the "
                                  "coordinator's log)")
    return JobStatus.FAILED, f"the service could not reach the job's coordinator: {type(error).__name__}: {first}"


def handling_failed(error: Exception) -> str:
    """A job's error when the service's own handling of it raised: what failed, in one line (the traceback is the
    service's, for its log: a user reading the job's error can act on neither)."""
    return (f"the service failed handling this job: {type(error).__name__}: {first_line(error)} (the traceback is "
            "in the service's log)")


class LiveJobs:
    def __init__(self, store: JobStore):
        self.store = store
        self.lock = threading.RLock()
        self._coordinators: dict[str, ray.actor.ActorHandle] = {}
        self._placement_groups: dict[str, PlacementGroup] = {}
        self._polls: dict[str, ray.ObjectRef] = {}
        self._cursors: dict[str, Cursor] = {}

    def add(self, job_id: str, coordinator: ray.actor.ActorHandle, pg: PlacementGroup, step: int) -> None:
        """Follow a job from `step` on (the caller holds `lock` when it must be atomic with the store)."""
        with self.lock:
            self._coordinators[job_id], self._placement_groups[job_id] = coordinator, pg
            self._cursors[job_id] = Cursor(step=step)

    def coordinator(self, job_id: str) -> ray.actor.ActorHandle | None:
        with self.lock:
            return self._coordinators.get(job_id)

    def read_up_to(self, job_id: str) -> int:
        """The next step whose metrics the store has not read yet."""
        with self.lock:
            return self._cursors.setdefault(job_id, Cursor(step=0)).step

    def snapshot(self) -> tuple[dict[str, ray.actor.ActorHandle], dict[str, int]]:
        """Every live job's coordinator, and the step the store has read each up to."""
        with self.lock:
            return dict(self._coordinators), {job_id: c.step for job_id, c in self._cursors.items()}

    def follow(self, timeout_s: float) -> None:
        """Poll every live coordinator; one that has not answered yet (e.g. still starting) is skipped."""
        with self.lock:
            for job_id, coordinator in self._coordinators.items():
                if job_id not in self._polls:
                    cursor = self._cursors.setdefault(job_id, Cursor(step=0))
                    events_from = cursor.events if cursor.incarnation is not None else None
                    self._polls[job_id] = coordinator.poll.remote(cursor.step, events_from=events_from)
            refs = {ref: job_id for job_id, ref in self._polls.items()}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            job_id = refs[ref]
            with self.lock:
                self._polls.pop(job_id, None)
            self.guarded(job_id, self._take_report, job_id, ref)

    def _take_report(self, job_id: str, ref: ray.ObjectRef) -> None:
        try:
            report = ray.get(ref)
        except ray.exceptions.RayError as e:
            status, error = coordinator_lost(e)
            if status is JobStatus.FAILED:
                self.finish(job_id, status, error)
            else:
                self.store.update(job_id, status=status)
            return
        self.apply(job_id, report)

    def guarded(self, job_id: str, handle: Callable[..., Any], *args: Any) -> Any:
        """Run one job's handling; an exception fails that job (a sentence; the traceback to the log) instead of the
        thread."""
        try:
            return handle(*args)
        except Exception as e:  # noqa: BLE001
            log.exception("job %s: %s failed", job_id, handle.__name__)
            self.finish(job_id, JobStatus.FAILED, handling_failed(e))
            return False

    def apply(self, job_id: str, report: dict) -> None:
        """Write a coordinator's report to the store; a terminal status ends the job."""
        with self.lock:
            cursor = self._cursors.setdefault(job_id, Cursor(step=0))
        status = apply_report(self.store, job_id, report, cursor)
        if status.is_terminal:
            self.finish(job_id, status)

    def finish(self, job_id: str, status: JobStatus, error: str | None = None) -> None:
        """Record the job's end (unless it has ended already), then release what it holds in Ray. In that
        order, a job's `ended_at` comes before the next job can be admitted into its resources."""
        self.store.update(job_id, status=status, error=error)
        self.release(job_id)

    def release(self, job_id: str) -> None:
        """Stop following the job: its coordinator killed, its placement groups (grown ones too) removed."""
        with self.lock:
            coordinator = self._coordinators.pop(job_id, None)
            pg = self._placement_groups.pop(job_id, None)
            self._polls.pop(job_id, None)
            self._cursors.pop(job_id, None)
        if coordinator is not None:
            ray.kill(coordinator, no_restart=True)
        if pg is not None:
            remove_placement_group(pg)
        remove_grown_placement_groups(job_id)
