"""The job manager: submit, follow, stop and delete jobs; the bridge from the store to the coordinators.

`submit` validates a JobConfig against the live cluster (plan rules, dataset, fit) before anything is
created, stores the job as PENDING and starts its Coordinator. A follower thread polls every live
coordinator and writes status, progress, metrics and errors to the store; once a job is terminal its
coordinator is killed (its workers and placement group are already released). On start-up, jobs the
store still shows as live belong to a service that is gone: they are marked FAILED.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import asdict

import ray

from actors.coordinator import Coordinator
from actors.naming import coordinator_name
from actors.state import JobStatus
from parallel.config import JobConfig
from parallel.data import open_dataset
from parallel.plan import ClusterResources, Plan, make_plan
from service.ray_runtime import cluster_resources
from service.store import JobRecord, JobStore

log = logging.getLogger("trainyard.manager")


class JobNotFound(KeyError):
    pass


class JobConflict(RuntimeError):
    """The request does not fit the job's state (e.g. deleting a running job)."""


class JobManager:
    def __init__(self, store: JobStore, dashboard_url: str | None = None, poll_interval_s: float = 0.5):
        self.store = store
        self.dashboard_url = dashboard_url
        self.poll_interval_s = poll_interval_s
        self._coordinators: dict[str, ray.actor.ActorHandle] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._reconcile()
        self._follower = threading.Thread(target=self._follow_loop, name="trainyard-follower", daemon=True)
        self._follower.start()

    # --- validation and submission -------------------------------------------------------------

    def plan(self, config: JobConfig) -> Plan:
        """All submit-time checks; raises PlanError (or DatasetError) naming the field and the rule."""
        plan = make_plan(config, cluster_resources())
        open_dataset(config)
        return plan

    def cluster(self) -> ClusterResources:
        return cluster_resources()

    def submit(self, config: JobConfig) -> str:
        plan = self.plan(config)
        job_id = uuid.uuid4().hex[:12]
        self.store.insert(JobRecord(job_id=job_id, name=config.name, status=JobStatus.PENDING,
                                    spec=asdict(config), steps=config.steps))
        coordinator = Coordinator.options(name=coordinator_name(job_id)).remote(job_id, plan)
        with self._lock:
            self._coordinators[job_id] = coordinator
        try:
            ray.get(coordinator.start.remote())
        except ray.exceptions.RayError as e:  # e.g. the code does not import on the cluster's workers
            self.store.update(job_id, status=JobStatus.FAILED, error=f"the job's coordinator did not start: {e}")
            self._finish(job_id, JobStatus.FAILED)
            log.error("job %s failed at start: %s", job_id, e)
            return job_id
        log.info("job %s submitted (%s, world size %d)", job_id, config.name, plan.world_size)
        return job_id

    # --- queries and control -------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord:
        job = self.store.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def list(self) -> list[JobRecord]:
        return self.store.list()

    def metrics(self, job_id: str, since: int = 0) -> list[dict]:
        self.get(job_id)
        return self.store.metrics(job_id, since)

    def stop(self, job_id: str, timeout_s: float = 60.0) -> JobRecord:
        job = self.get(job_id)
        if job.status.is_terminal:
            return job
        with self._lock:
            coordinator = self._coordinators.get(job_id)
        if coordinator is not None:
            try:
                self._apply(job_id, ray.get(coordinator.stop.remote(), timeout=timeout_s))
            except Exception as e:  # noqa: BLE001 - killing the coordinator below releases everything
                log.warning("job %s: stop did not finish cleanly (%s); killing its coordinator", job_id, e)
        self._finish(job_id, JobStatus.STOPPED)
        return self.get(job_id)

    def delete(self, job_id: str) -> None:
        job = self.get(job_id)
        if not job.status.is_terminal:
            raise JobConflict(f"job {job_id} is {job.status}; stop it before deleting it")
        self.store.delete(job_id)

    def shutdown(self) -> None:
        """Stop following; live jobs are stopped so that nothing is left holding the cluster."""
        self._stopping.set()
        self._follower.join(timeout=10)
        for job_id in list(self._coordinators):
            self.stop(job_id)

    # --- following coordinators ----------------------------------------------------------------

    def _follow_loop(self) -> None:
        while not self._stopping.wait(self.poll_interval_s):
            with self._lock:
                live = list(self._coordinators.items())
            for job_id, coordinator in live:
                self._poll(job_id, coordinator)

    def _poll(self, job_id: str, coordinator) -> None:
        job = self.store.get(job_id)
        if job is None:
            return
        try:
            self._apply(job_id, ray.get(coordinator.poll.remote(job.step)))
        except ray.exceptions.RayActorError as e:
            self.store.update(job_id, status=JobStatus.FAILED, error=f"the job's coordinator died: {e}")
            self._finish(job_id, JobStatus.FAILED)

    def _apply(self, job_id: str, report: dict) -> None:
        if report["metrics"]:
            self.store.add_metrics(job_id, report["metrics"])
        status = JobStatus(report["status"])
        self.store.update(job_id, status=status, step=report["step"], error=report["error"],
                          actors=report["actors"])
        if status.is_terminal:
            self._finish(job_id, status)

    def _finish(self, job_id: str, status: JobStatus) -> None:
        with self._lock:
            coordinator = self._coordinators.pop(job_id, None)
        if coordinator is not None:
            ray.kill(coordinator, no_restart=True)
        job = self.store.get(job_id)
        if job is not None and not job.status.is_terminal:
            self.store.update(job_id, status=status)

    def _reconcile(self) -> None:
        for job in self.store.list():
            if not job.status.is_terminal:
                self.store.update(job.job_id, status=JobStatus.FAILED,
                                  error="the service stopped while this job was live; resubmit it")
