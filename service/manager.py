"""The job manager: the service's one entry point for the API (submit, queries, control) and the owner of its two
threads. What each thread does lives beside it: admission (`service.admission.admit`, with the policy in
`service.admission.queue`), following the live jobs (`service.following.live_jobs`, with `service.following.follow`),
making the store true to Ray at start (`service.following.reconcile`), what a submitted job reads (`service.inputs`),
where a job's files go (`service.paths`), resume points (`service.resume`) and logs (`service.logs`).

- `submit` validates a JobConfig against the cluster (plan rules, dataset, fit, its owner's quota), stores the job
  as PENDING, owned by the submitter, and returns: a waiting job is a row in the store and holds no Ray process.
  Who may see and control which job is the API's rule (`service.tenancy.users` has the users).
- The admission thread takes the head of the queue (`service.admission.queue`) when its whole gang fits the free
  resources, reserves its placement group (ready at once, or given back and tried again later), and only
  then starts the job's Coordinator with that placement group.
- The follower thread polls every live coordinator without waiting on any one of them and writes status,
  progress, metrics and errors to the store; once a job is terminal its coordinator is killed and its
  placement group removed. A poll asks only for what is new (`service.following.follow`).
- No checkpoint is hashed here, on the API's or the admission thread's path (`service.resume`).
- Neither thread dies with one job: an exception in one job's handling is logged and fails that job.
- A Tinker training client (`service.tinker`) is a job of kind `tinker`: queued and admitted as jobs are, its ranks
  built by its own actor instead of a coordinator; `stop` ends it as its unload does.
- `logs` reads a rank's log through Ray's log API (`service.logs`), also after the job ended.
- Jobs outlive the service. On a cluster the service joined (`detach_jobs`), coordinators and placement
  groups are detached Ray objects: shutdown leaves them running, and the next start reattaches to every
  coordinator still alive. On the embedded cluster, which goes down with the service, shutdown has live
  jobs write a final checkpoint and queues them again; jobs the store shows as running with no coordinator
  left (the service was killed) are queued again too; each goes on from its latest checkpoint.
"""

from __future__ import annotations

import builtins
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path

import ray
from trainyard.actors import tracking
from trainyard.actors.state import JobStatus
from trainyard.parallel.config import JobConfig, ParallelConfig
from trainyard.parallel.data.datasets import Dataset, open_dataset
from trainyard.parallel.io.hf_spec import init_from_event
from trainyard.parallel.plan import ClusterResources, Plan, make_plan, reaching_max, resize_plan
from trainyard.parallel.plan.job_plan import dp_range
from trainyard.parallel.spec import parse_spec, spec_to_dict
from trainyard.service.admission import queue
from trainyard.service.admission.admit import RESERVE_TIMEOUT_S, Admission
from trainyard.service.calibration import Calibrations
from trainyard.service.errors import Calibrating, JobConflict, JobNotFound, QueueFull, RankNotFound
from trainyard.service.following.live_jobs import LiveJobs
from trainyard.service.following.reconcile import reconcile
from trainyard.service.inputs import bound_by_epochs, check_inputs
from trainyard.service.logs import job_logs
from trainyard.service.paths import JobPaths
from trainyard.service.ray_runtime import cluster_resources
from trainyard.service.resume import resume_point
from trainyard.service.stopping import stop_interrupted
from trainyard.service.store import JobRecord, JobStore
from trainyard.service.tenancy import quota
from trainyard.service.tenancy.requests import Tenancy
from trainyard.service.tenancy.trackers import TrackerPolicy
from trainyard.service.tenancy.users import ADMIN_USER, User
from trainyard.service.tinker import TinkerClients

log = logging.getLogger("trainyard.manager")

__all__ = ["JobConflict", "JobManager", "JobNotFound", "QueueFull", "RankNotFound"]

SHUTDOWN_TIMEOUT_S = 10.0
"""How long shutdown waits for the live jobs' coordinators to stop cleanly before killing them."""


def _reaching_max(config: JobConfig, events: builtins.list[dict]) -> tuple[JobConfig, builtins.list[dict]]:
    """An elastic job stored with the micro-batches that reach its max (`parallel.plan.reaching_max`), with an
    event when they are not the ones asked for; PlanError naming the sizes it can reach when none do."""
    chosen = reaching_max(config)
    if chosen is config:  # a fixed size, `auto`, or micro-batches that reach max already
        return config, events
    limits, before, after = dp_range(config), config.parallel, chosen.parallel
    assert limits is not None and isinstance(before, ParallelConfig) and isinstance(after, ParallelConfig)  # elastic
    asked, microbatches = before.microbatches, after.microbatches
    cause = (f"parallel.microbatches {asked} -> {microbatches}: micro-batches of "
             f"{config.global_batch // (limits[0] * microbatches)} sequences, which dp={limits[1]} (max) keeps too")
    return chosen, [*events, {"time": time.time(), "kind": "micro_batches", "cause": cause}]


class JobManager:
    def __init__(self, store: JobStore, dashboard_url: str | None = None, poll_interval_s: float = 0.5,
                 max_queued: int = 1000, admit: bool = True, data_dir: Path | None = None,
                 detach_jobs: bool = False, quotas: queue.Quotas = lambda _: quota.NO_QUOTA,
                 trackers: TrackerPolicy = TrackerPolicy()):
        """`admit=False` keeps every job waiting (maintenance, and the API fuzz test). `data_dir` holds the
        jobs' checkpoints and trained models and the users' uploads (default: beside the store). `detach_jobs`: the
        cluster outlives the service, and so do its jobs (see the module docstring). `quotas`: each user's, by
        name. `trackers`: where jobs' trackers may log (`service.tenancy.trackers`)."""
        self.store = store
        self.detach_jobs = detach_jobs
        self.data_dir = data_dir or store.path.parent
        self.paths = JobPaths(self.data_dir)
        self.dashboard_url = dashboard_url
        self.poll_interval_s = poll_interval_s
        self.max_queued = max_queued
        self.admit = admit
        self.quotas = quotas
        self.tenancy = Tenancy(store, store.path.parent, self.paths, quotas, trackers, plan=self.plan)
        self.tenancy.uploads.sweep_partial()
        self.calibrations = Calibrations(self.data_dir)
        self.tinker = TinkerClients(self.tenancy)  # the Tinker-compatible API's sessions and live clients
        self.live = LiveJobs(store)
        self.admission = Admission(self.live, self.paths, self.resume_point, detach_jobs,
                                   choose_layout=lambda config: self.choose_layout(config)[0], quotas=quotas,
                                   start_client=self.tinker.admitted)
        self._stopping, self._wake = threading.Event(), threading.Event()
        self.tinker.wake = self._wake.set
        # Ray builds its serialization context on the first call with arguments, importing pydantic.v1 as it
        # does; in the admission thread, racing the API's thread importing pydantic, that import once failed
        # (KeyError: 'pydantic.v1') and failed the job being admitted. Build it here, before any thread (the service
        # connects to Ray first; a manager without Ray, as in unit tests, must not start one).
        if ray.is_initialized():
            ray.put(None)
        reconcile(self.live)
        self._threads = [threading.Thread(target=self._loop, args=(body, wake), name=f"trainyard{name}", daemon=True)
                         for name, body, wake in (("_admit_queued", self._admit_queued, self._wake),
                                                  ("_follow", self._follow, threading.Event()))]
        for thread in self._threads:
            thread.start()

    # --- validation and submission -------------------------------------------------------------

    def plan(self, config: JobConfig, train: Dataset | None = None) -> Plan:
        """All submit-time checks; raises PlanError (or DatasetError) naming the field and the rule. `train`: the
        training data, when the caller opened it already."""
        plan = make_plan(config, cluster_resources())
        check_inputs(config, self.resume_point, train)
        return plan

    def choose_layout(self, config: JobConfig) -> tuple[JobConfig, dict | None]:
        """`parallel: auto` resolved by the planner with this cluster's calibrated costs (measured on first
        use, in the background: `service.calibration`): the config to run and the ranking (None for a layout
        written by hand). Raises the first rule no layout changes (PlanError) before anything else, so an auto
        spec is told what a fixed one is whatever the costs' state; then Calibrating while they are measured."""
        if config.parallel != "auto":
            return config, None
        from trainyard.parallel.plan.planner.planner import choose
        from trainyard.parallel.plan.rules import layout_free_violations

        errors = layout_free_violations(config)
        if errors:
            raise errors[0]

        cluster = cluster_resources()
        chosen, result = choose(config, cluster, self.calibrations.costs(cluster))
        return chosen, result.to_dict()

    def tracking(self, job_id: str) -> dict[str, str]:
        """Where the job's trackers write (`actors.tracking.locations`): empty when its spec asks for none."""
        config = parse_spec(self.get(job_id).spec)
        return tracking.locations(config, self.paths.checkpoint_root(job_id, config))

    def resume_point(self, config: JobConfig) -> tuple[str, int] | None:
        """The checkpoint `resume_from` names, checked without hashing it (see `service.resume`)."""
        return resume_point(self.store, self.paths.checkpoint_root, config)

    def cluster(self) -> ClusterResources:
        return cluster_resources()

    # --- submission ------------------------------------------------------------------------------------------

    def submit(self, config: JobConfig, user: User = ADMIN_USER) -> str:
        """Validate and queue `user`'s job; returns at once (the admission thread starts it when it fits). A
        `parallel: auto` job submitted while the node type's costs are being measured is queued all the same,
        with an event saying it waits for them: the admission thread chooses its layout once they are known. A
        job that needs more than its owner's whole quota is refused (RuleError on `resources`), as a priority
        above the user's `max_priority` (on `priority`) and trackers not the operator's (`service.tenancy.trackers`); an
        elastic job's `dp.max` is lowered to what the quota holds (`service.tenancy.requests`). `config`'s paths
        were resolved by `tenancy.confine`."""
        owner = user.name
        config = self.tenancy.for_user(config, user)
        self.tenancy.check_storage(user)
        # Opened once, here, where the epochs' steps and the input checks both need it (`service.inputs`).
        train = open_dataset(config) if config.data.epochs is not None else None
        config, events = bound_by_epochs(config, train)
        config, events = _reaching_max(config, events)
        try:
            config, _ = self.choose_layout(config)
        except Calibrating as waiting:
            check_inputs(config, self.resume_point, train)
            event = {"time": time.time(), "kind": "waiting_for_calibration", "cause": str(waiting)}
            return self._queue(config, user, needs={}, events=[*events, event])
        plan = self.plan(config, train)
        config, plan, capped = self.tenancy.elastic_within_quota(config, plan, user)
        largest = plan.dp_range[1] if plan.dp_range else None  # an elastic job is charged at its max
        quota.check(self.quotas(owner), quota.charge(plan, largest), "resources")  # over what is left: it waits
        job_id = self._queue(config, user, needs=quota.needs(plan, largest), events=events + capped)
        log.info("job %s queued (%s, world size %d, priority %d, user %s)", job_id, config.name, plan.world_size,
                 config.priority, owner)
        return job_id

    def _queue(self, config: JobConfig, user: User, needs: dict, events: builtins.list[dict] | None = None) -> str:
        owner = user.name
        job_id = uuid.uuid4().hex[:12]
        claimed = init_from_event(config, time.time())  # which family reads init_from.hf
        events = ([claimed] if claimed else []) + (events or [])
        with self.live.lock:  # the count and the insert together, so concurrent submits cannot overshoot
            if self.store.queued_count() >= self.max_queued:
                raise QueueFull(f"the queue already holds {self.max_queued} waiting jobs (--max-queued); "
                                "submit again when some have started, or stop some")
            if user.max_queued is not None and self.store.queued_count(owner) >= user.max_queued:
                raise QueueFull(f"user {owner} already has {user.max_queued} jobs waiting (their --max-queued); "
                                "submit again when some have started, or stop some")
            self.store.insert(JobRecord(job_id=job_id, name=config.name, status=JobStatus.PENDING,
                                        spec=spec_to_dict(config), steps=config.steps, priority=config.priority,
                                        needs=needs, events=events or [], owner=owner))
        self._wake.set()
        return job_id

    # --- queries and control -------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord:
        job = self.store.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def list(self, owner: str | None = None) -> builtins.list[JobRecord]:
        """Every job, or `owner`'s."""
        return self.store.list(owner)

    def queue_view(self) -> dict[str, tuple[int, dict]]:
        """job_id -> (queue position from 1, what it waits for) for every waiting job."""
        waiting, held = self.admission.waiting()
        return queue.view(waiting, self.admission.free, held, self.quotas)

    def metrics(self, job_id: str, since: int = 0) -> builtins.list[dict]:
        self.get(job_id)
        return self.store.metrics(job_id, since)

    def logs(self, job_id: str, rank: int | None = None, stream: str = "stderr", tail: int = 1000,
             since: int | None = None) -> dict:
        """The log of one rank, or of every rank, read from Ray (`service.logs`)."""
        return job_logs(self.get(job_id), rank, stream, tail, since)

    def stop(self, job_id: str, timeout_s: float = 60.0) -> JobRecord:
        with self.live.lock:
            job = self.get(job_id)
            if job.status.is_terminal or job.kind == "tinker":  # a Tinker client: as its unload
                if not job.status.is_terminal:
                    self.tinker.stop(job_id)
                return self.get(job_id)
            coordinator = self.live.coordinator(job_id)
            if coordinator is None:  # still in the queue: nothing runs and nothing is reserved
                stopped = self.store.update(job_id, status=JobStatus.STOPPED)
        if coordinator is None:
            if stopped:
                stop_interrupted(self.store, self.paths, job)
            return self.get(job_id)
        since = self.live.read_up_to(job_id)
        try:
            self.live.apply(job_id, ray.get(coordinator.stop.remote(since=since), timeout=timeout_s))
        except Exception as e:  # noqa: BLE001 - killing the coordinator below releases everything
            log.warning("job %s: stop did not finish cleanly (%s); killing its coordinator", job_id, e)
        self.live.finish(job_id, JobStatus.STOPPED)
        return self.get(job_id)

    def model_file(self, job_id: str) -> Path:
        """The trained model of an ended job (SUCCEEDED or STOPPED after at least one step)."""
        job = self.get(job_id)
        if job.status not in (JobStatus.SUCCEEDED, JobStatus.STOPPED):
            raise JobConflict(f"job {job_id} is {job.status}; its model is written when it ends SUCCEEDED or "
                              "STOPPED")
        path = self.paths.model_path(job_id)
        if not path.is_file():
            raise JobConflict(f"job {job_id} ended without a model (it stopped before finishing a step, or was "
                              "stopped while a step hung)")
        return path

    def events(self, job_id: str) -> builtins.list[dict]:
        return self.get(job_id).events

    def inject_fault(self, job_id: str, kind: str, rank: int, at_step: int, factor: float = 3.0) -> dict:
        """Schedule a fault drill in a running job (the API allows it only under --allow-fault-injection)."""
        job = self.get(job_id)
        coordinator = self.live.coordinator(job_id)
        if job.status is not JobStatus.RUNNING or coordinator is None:
            raise JobConflict(f"job {job_id} is {job.status}; a drill needs a RUNNING job")
        workers = len(job.ranks) or make_plan(parse_spec(job.spec)).world_size
        if rank >= workers:
            raise RankNotFound(f"job {job_id} has no rank {rank}; its ranks are 0 to {workers - 1}")
        ray.get(coordinator.inject.remote(kind, rank, at_step, factor), timeout=30)
        return {"job_id": job_id, "kind": kind, "rank": rank, "at_step": at_step} | (
            {"factor": factor} if kind == "slow_rank" else {})

    def scale(self, job_id: str, dp: int) -> dict:
        """Resize a running job to `dp` data-parallel replicas at its next step boundary. PlanError (422) when
        the job cannot take that size on this cluster; JobConflict (409) when it is not RUNNING or the added
        ranks' resources are not free."""
        job = self.get(job_id)
        needed = quota.charge(resize_plan(make_plan(parse_spec(job.spec)), dp, cluster_resources()))
        held = quota.usage(self.store.live_needs(), leave_out=job_id).get(job.owner, {})
        quota.check(self.quotas(job.owner), needed, "dp", held)
        coordinator = self.live.coordinator(job_id)
        if job.status is not JobStatus.RUNNING or coordinator is None:
            raise JobConflict(f"job {job_id} is {job.status}; only a RUNNING job can be resized")
        answer = ray.get(coordinator.scale.remote(dp, "request"), timeout=60)
        if "refused" in answer:
            raise JobConflict(answer["refused"])
        return {"job_id": job_id, **answer}

    def delete(self, job_id: str) -> None:
        job = self.get(job_id)
        if not job.status.is_terminal:
            raise JobConflict(f"job {job_id} is {job.status}; stop it before deleting it")
        if not self.store.delete(job_id):  # deleted by a concurrent request in between
            raise JobNotFound(job_id)
        # Its files go with it: its model and its checkpoints (also those under a `checkpoint.path`).
        shutil.rmtree(self.paths.model_path(job_id).parent, ignore_errors=True)
        shutil.rmtree(self.paths.checkpoint_root(job_id, parse_spec(job.spec)), ignore_errors=True)

    def shutdown(self) -> None:
        """Stop admitting and following. Live jobs go on (detached), or checkpoint and are queued again within
        a few seconds. Waiting jobs stay queued in the store for the next start."""
        self._stopping.set()
        self._wake.set()
        self.tinker.close()
        for thread in self._threads:
            thread.join(timeout=RESERVE_TIMEOUT_S + 5)
        live, read = self.live.snapshot()
        if self.detach_jobs:
            log.info("%d live jobs go on without the service; the next start reattaches to them", len(live))
            return
        # The jobs are not over: each writes a final checkpoint and goes back into the queue, to go on from it
        # when the service comes back.
        stops = {job_id: coordinator.stop.remote(suspend=True, since=read.get(job_id, 0))
                 for job_id, coordinator in live.items()}
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for job_id, ref in stops.items():
            try:
                report = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                if report["metrics"]:
                    self.store.add_metrics(job_id, report["metrics"])
                # The step too: the job goes on from the final checkpoint, which is at this step. Without it the
                # store kept the last poll's step, and the job seemed to jump ahead when its next coordinator
                # first answered, before it had run a step.
                self.store.update(job_id, step=report["step"], events=report["events"])
            except Exception as e:  # noqa: BLE001
                log.warning("job %s: no final checkpoint at shutdown (%s); it goes on from its latest", job_id, e)
            self.store.interrupt(job_id, {"time": time.time(), "kind": "interrupted",
                                          "cause": "the service shut down; the job goes on when it is back"})
            self.live.release(job_id)

    # --- background threads --------------------------------------------------------------------

    def _loop(self, body, wake: threading.Event) -> None:
        """Run `body` every poll interval (or when woken) until shutdown; an exception never ends the loop."""
        while not self._stopping.is_set():
            try:
                body()
            except Exception:  # noqa: BLE001 - e.g. the store or Ray answered an error; try again next tick
                log.exception("%s failed; retrying", body.__name__)
            wake.wait(self.poll_interval_s)
            wake.clear()

    def _admit_queued(self) -> None:
        if self.admit:
            self.admission.admit_queued(self._stopping.is_set)

    def _follow(self) -> None:
        self.live.follow(self.poll_interval_s)
