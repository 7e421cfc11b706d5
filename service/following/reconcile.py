"""The store made true to Ray when the service starts: every job the store shows as admitted or running is
either followed again (its coordinator outlived the previous service, on a cluster the service joined) or
queued again, to go on from its latest checkpoint (its coordinator died with the service, or with the embedded
cluster). A Tinker training client (a job of kind `tinker`) ends FAILED: its actor was the service's."""

from __future__ import annotations

import contextlib
import logging
import time

import ray
from ray.util.placement_group import remove_placement_group
from trainyard.actors.naming import coordinator_name, placement_group_name
from trainyard.actors.state import JobStatus
from trainyard.service.following.live_jobs import LiveJobs
from trainyard.service.store import JobRecord

log = logging.getLogger("trainyard.manager")

CLIENT_GONE = ("the service restarted: a Tinker training client's ranks do not outlive it; its saved states remain "
               "(create a training client from one)")


def reconcile(live: LiveJobs) -> None:
    store = live.store
    for job in store.list():
        if job.kind == "tinker" and not job.status.is_terminal:
            # A Tinker training client's actor is the service's: it died with it, and nothing can take the SDK's
            # calls in flight back. Its saved states stay (`save_state`): a new client loads one.
            with contextlib.suppress(Exception):
                remove_placement_group(ray.util.get_placement_group(placement_group_name(job.job_id)))
            store.update(job.job_id, status=JobStatus.FAILED, error=CLIENT_GONE)
        elif job.status is JobStatus.PENDING and job.admitted_at is not None:
            if reattach(live, job):  # a joined cluster: its coordinator is still verifying its start point
                continue
            # Admitted but not yet running: its reservation died with Ray, or (detached) is given back here.
            # Its coordinator may have been verifying the point to start from; the job was interrupted too.
            with contextlib.suppress(Exception):
                remove_placement_group(ray.util.get_placement_group(placement_group_name(job.job_id)))
            store.requeue(job.job_id, {"time": time.time(), "kind": "interrupted",
                                       "cause": "the service stopped while the job was being started; it goes on "
                                                "from its latest checkpoint, if any"})
        elif not job.status.is_terminal and job.status is not JobStatus.PENDING and not reattach(live, job):
            # The service went down without stopping it (killed): it goes on from its latest checkpoint.
            store.interrupt(job.job_id, {"time": time.time(), "kind": "interrupted",
                                         "cause": "the service stopped while the job ran; it goes on from its "
                                                  "latest checkpoint"})


def reattach(live: LiveJobs, job: JobRecord) -> bool:
    """Follow a job whose coordinator outlived the previous service (a joined cluster); False if none."""
    try:
        coordinator = ray.get_actor(coordinator_name(job.job_id))
        pg = ray.util.get_placement_group(placement_group_name(job.job_id))
        ray.get(coordinator.add_event.remote({"time": time.time(), "kind": "reattached",
                                              "cause": "the service came back and follows the job again"}),
                timeout=30)
    except Exception:  # noqa: BLE001 - gone (ValueError), or dead: the job is relaunched instead
        return False
    # The previous service may have died between creating the coordinator and starting it (`Admission._admit`):
    # then nobody would, and the job stayed PENDING with its coordinator idle (found by the soak, `python -m
    # bench.run --only soak`). `start` is idempotent: a running coordinator goes on as it was.
    coordinator.start.remote()
    live.add(job.job_id, coordinator, pg, job.step)
    log.info("job %s: reattached to its running coordinator", job.job_id)
    return True
