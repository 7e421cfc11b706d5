"""The job manager: the service's one entry point for the API (submit, queries, control) and the owner of its
two threads. What each thread does lives beside it: admission (`service.admission`, with the policy in
`service.queue`), following the live jobs (`service.live_jobs`, with `service.follow`), making the store true
to Ray at start (`service.reconcile`), what a submitted job reads (`service.inputs`), where a job's files go
(`service.paths`), resume points (`service.resume`) and logs (`service.logs`).

- `submit` validates a JobConfig against the cluster (plan rules, dataset, fit, its owner's quota), stores the job
  as PENDING, owned by the submitter, and returns: a waiting job is a row in the store and holds no Ray process.
  Who may see and control which job is the API's rule (`service.users` has the users).
- The admission thread takes the head of the queue (`service.queue`) when its whole gang fits the free
  resources, reserves its placement group (ready at once, or given back and tried again later), and only
  then starts the job's Coordinator with that placement group.
- The follower thread polls every live coordinator without waiting on any one of them and writes status,
  progress, metrics and errors to the store; once a job is terminal its coordinator is killed and its
  placement group removed. A poll asks only for what is new (`service.follow`).
- No checkpoint is hashed here, on the API's or the admission thread's path (`service.resume`).
- Neither thread dies with one job: an exception in one job's handling is logged and fails that job.
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
from typing import Any

import ray
from trainyard.actors import tracking
from trainyard.actors.journal import read_metrics_log, steps_logged
from trainyard.actors.policies import largest_size
from trainyard.actors.state import JobStatus
from trainyard.parallel.config import JobConfig, ParallelConfig, RuleError
from trainyard.parallel.data.datasets import Dataset, open_dataset
from trainyard.parallel.io import checkpoint
from trainyard.parallel.io.hf_spec import init_from_event
from trainyard.parallel.plan import ClusterResources, Plan, make_plan, reaching_max, resize_plan, with_dp_max
from trainyard.parallel.plan.job_plan import dp_range
from trainyard.parallel.spec import parse_spec, spec_to_dict
from trainyard.service import queue, quota, uploads
from trainyard.service.access import Access
from trainyard.service.admission import RESERVE_TIMEOUT_S, Admission
from trainyard.service.calibration import Calibrations
from trainyard.service.errors import Calibrating, JobConflict, JobNotFound, QueueFull, RankNotFound
from trainyard.service.inputs import bound_by_epochs, check_inputs
from trainyard.service.live_jobs import LiveJobs
from trainyard.service.logs import read_rank_log
from trainyard.service.paths import JobPaths
from trainyard.service.ray_runtime import cluster_resources
from trainyard.service.reconcile import reconcile
from trainyard.service.resume import resume_point
from trainyard.service.store import JobRecord, JobStore
from trainyard.service.trackers import TrackerPolicy
from trainyard.service.uploads import Uploads
from trainyard.service.users import ADMIN_USER, User

log = logging.getLogger("trainyard.manager")

__all__ = ["JobConflict", "JobManager", "JobNotFound", "QueueFull", "RankNotFound"]

SHUTDOWN_TIMEOUT_S = 10.0
"""How long shutdown waits for the live jobs' coordinators to stop cleanly before killing them."""


@ray.remote(num_cpus=0)
def _export_latest(config: JobConfig, root: str, out: str) -> int | None:
    """The model of a job's latest intact checkpoint (hashed) written to `out`; its step (None: no checkpoint). A
    Ray task: the service imports no torch, and hashes no checkpoint on the API's path."""
    from trainyard.parallel.io.export import export_model

    found = checkpoint.latest_valid(Path(root), at_most=steps_logged(Path(root)))
    if found is None:
        return None
    export_model(config, found.directory, found.step, Path(out))
    return found.step


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
        name. `trackers`: where jobs' trackers may log (`service.trackers`)."""
        self.store = store
        self.detach_jobs = detach_jobs
        self.data_dir = data_dir or store.path.parent
        self.paths = JobPaths(self.data_dir)
        self.access = Access(store.path.parent, self.data_dir, owns=self._owns)
        self.uploads = Uploads(self.access.uploads_root)
        self.uploads.sweep_partial()
        self.trackers = trackers
        self.dashboard_url = dashboard_url
        self.poll_interval_s = poll_interval_s
        self.max_queued = max_queued
        self.admit = admit
        self.quotas = quotas
        self.calibrations = Calibrations(self.data_dir)
        self.live = LiveJobs(store)
        self.admission = Admission(self.live, self.paths, self.resume_point, detach_jobs,
                                   choose_layout=lambda config: self.choose_layout(config)[0], quotas=quotas)
        self._stopping = threading.Event()
        self._wake = threading.Event()
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
        from trainyard.parallel.plan.planner import choose
        from trainyard.parallel.plan.rules import layout_free_violations

        errors = layout_free_violations(config)
        if errors:
            raise errors[0]

        cluster = cluster_resources()
        chosen, result = choose(config, cluster, self.calibrations.costs(cluster))
        return chosen, result.to_dict()

    # --- where a job's files live ---------------------------------------------------------------

    def checkpoint_root(self, job_id: str, config: JobConfig) -> Path:
        return self.paths.checkpoint_root(job_id, config)

    def model_path(self, job_id: str) -> Path:
        return self.paths.model_path(job_id)

    def tracking(self, job_id: str) -> dict[str, str]:
        """Where the job's trackers write (`actors.tracking.locations`): empty when its spec asks for none."""
        config = parse_spec(self.get(job_id).spec)
        return tracking.locations(config, self.checkpoint_root(job_id, config))

    def resume_point(self, config: JobConfig) -> tuple[str, int] | None:
        """The checkpoint `resume_from` names, checked without hashing it (see `service.resume`)."""
        return resume_point(self.store, self.checkpoint_root, config)

    def cluster(self) -> ClusterResources:
        return cluster_resources()

    # --- what a request names, resolved against its owner (`service.access`) ---------------------------------

    def confine(self, spec: Any, user: User = ADMIN_USER) -> Any:
        """A submitted spec (parsed JSON, before validation) with every path and job it names resolved against
        `user`: paths under their areas (`service.access`), `resume_from.job_id` and `init_from.job_id` jobs of
        theirs (another user's answers as a missing one), `init_from.job_id` resolved to that job's model as a
        Hugging Face directory (`init_from.hf`). RuleError naming the field otherwise."""
        spec = self.access.confine(user.owner, spec)
        if not isinstance(spec, dict):
            return spec
        resume, init = spec.get("resume_from"), spec.get("init_from")
        if isinstance(resume, dict) and isinstance(resume.get("job_id"), str):
            self._job_of(user, resume["job_id"], "resume_from.job_id")
        if isinstance(init, dict) and isinstance(init.get("job_id"), str):
            job = self._job_of(user, init["job_id"], "init_from.job_id")
            init["hf"] = str(self._model_directory(job))
        return spec

    def _owns(self, job_id: str, owner: str) -> bool:
        job = self.store.get(job_id)
        return job is not None and job.owner == owner

    def _job_of(self, user: User, job_id: str, field: str) -> JobRecord:
        """Job `job_id` if `user` may name it (theirs; any, for an admin); else RuleError, as for no such job."""
        job = self.store.get(job_id)
        if job is None or not (user.admin or job.owner == user.name):
            raise RuleError(field, f"no job {job_id}")
        return job

    def _model_directory(self, job: JobRecord) -> Path:
        """An ended job's trained model as a Hugging Face directory (made once, beside its model file)."""
        path = self.model_path(job.job_id)
        if job.status not in (JobStatus.SUCCEEDED, JobStatus.STOPPED) or not path.is_file():
            raise RuleError("init_from.job_id", f"job {job.job_id} is {job.status} without a model; a job starts "
                                                "from one that ended SUCCEEDED or STOPPED")
        from trainyard.service.hf_export import hf_directory  # torch: only when asked for

        return hf_directory(path, job.spec)

    def storage_used(self, user: str) -> int:
        """The bytes of `user`'s uploads and of their jobs' checkpoints and models."""
        folders = [self.uploads.folder(user)]
        for job in self.store.list(user):
            folders += [self.model_path(job.job_id).parent, self.checkpoint_root(job.job_id, parse_spec(job.spec))]
        return uploads.storage_used(folders)

    def upload_limit(self, user: User, limit: int) -> int:
        """The most bytes `user`'s next upload may take: `limit` (one upload's), or what their storage quota
        leaves (JobConflict: nothing is left)."""
        if user.max_storage_bytes is not None:
            left = user.max_storage_bytes - self.storage_used(user.name)
            if left <= 0:
                raise JobConflict(self._storage_full(user))
            limit = min(limit, left)
        return limit

    @staticmethod
    def _storage_full(user: User) -> str:
        return (f"user {user.name}'s storage quota ({user.max_storage_bytes} bytes of uploads, checkpoints and "
                "models) is used up; delete uploads (`trainyard files rm`) or jobs (`trainyard delete`)")

    # --- submission ------------------------------------------------------------------------------------------

    def for_user(self, config: JobConfig, user: User) -> JobConfig:
        """What a user's spec may not ask for: a priority above their `max_priority` (RuleError on `priority`),
        trackers other than the operator's (`service.trackers`); the config with the operator's trackers."""
        if user.max_priority is not None and config.priority > user.max_priority:
            raise RuleError("priority", f"at most {user.max_priority} for user {user.name} (an admin sets it: "
                                        "`trainyard token update NAME --max-priority N`)")
        return self.trackers.apply(config, user.admin)

    def submit(self, config: JobConfig, user: User = ADMIN_USER) -> str:
        """Validate and queue `user`'s job; returns at once (the admission thread starts it when it fits). A
        `parallel: auto` job submitted while the node type's costs are being measured is queued all the same,
        with an event saying it waits for them: the admission thread chooses its layout once they are known. A
        job that needs more than its owner's whole quota is refused (RuleError on `resources`), as a priority
        above the user's `max_priority` (on `priority`) and trackers not the operator's (`service.trackers`); an
        elastic job's `dp.max` is lowered to what the quota holds. `config`'s paths were resolved by `confine`."""
        owner = user.name
        config = self.for_user(config, user)
        if user.max_storage_bytes is not None and self.storage_used(owner) >= user.max_storage_bytes:
            raise JobConflict(self._storage_full(user))
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
        config, plan, capped = self._elastic_within_quota(config, plan, user)
        largest = plan.dp_range[1] if plan.dp_range else None  # an elastic job is charged at its max
        quota.check(self.quotas(owner), quota.charge(plan, largest), "resources")  # over what is left: it waits
        job_id = self._queue(config, user, needs=quota.needs(plan, largest), events=events + capped)
        log.info("job %s queued (%s, world size %d, priority %d, user %s)", job_id, config.name, plan.world_size,
                 config.priority, owner)
        return job_id

    def _elastic_within_quota(self, config: JobConfig, plan: Plan, user: User
                              ) -> tuple[JobConfig, Plan, builtins.list[dict]]:
        """An elastic job whose `dp.max` is more than its owner's whole quota holds, with `dp.max` lowered to the
        largest size the quota holds and the plan's rules allow (and an event saying so); else as it is."""
        if plan.dp_range is None:
            return config, plan, []
        low, high = plan.dp_range
        fits = quota.replicas_within(self.quotas(user.name), quota.charge(plan, at_dp=1))
        if fits is None or fits >= high or fits < low:  # below the minimum: the quota check refuses it
            return config, plan, []
        size = largest_size(plan, fits)
        if size is None:
            return config, plan, []
        capped = with_dp_max(config, size)
        event = {"time": time.time(), "kind": "elastic_within_quota", "dp_max": size, "asked": high,
                 "cause": f"parallel.dp.max={high} is more than user {user.name}'s quota holds: the job grows to "
                          f"dp={size} at most"}
        return capped, self.plan(capped), [event]

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
        """The log of one rank, or of every rank, read from Ray (see `service.logs.read_rank_log`)."""
        job = self.get(job_id)
        if not job.ranks:
            state = "has not started its workers yet" if not job.status.is_terminal else "never started its workers"
            raise JobConflict(f"job {job_id} is {job.status} and {state}, so it has no rank logs")
        chosen = [r for r in job.ranks if rank is None or r["rank"] == rank]
        if not chosen:
            raise RankNotFound(f"job {job_id} has no rank {rank}; its ranks are 0 to {len(job.ranks) - 1}")
        return {"job_id": job_id, "status": job.status.value, "stream": stream,
                "ranks": [read_rank_log(r, stream, tail, since) for r in chosen]}

    def stop(self, job_id: str, timeout_s: float = 60.0) -> JobRecord:
        with self.live.lock:
            job = self.get(job_id)
            if job.status.is_terminal:
                return job
            coordinator = self.live.coordinator(job_id)
            if coordinator is None:  # still in the queue: nothing runs and nothing is reserved
                stopped = self.store.update(job_id, status=JobStatus.STOPPED)
        if coordinator is None:
            if stopped:
                self._stop_queued(job)
            return self.get(job_id)
        since = self.live.read_up_to(job_id)
        try:
            self.live.apply(job_id, ray.get(coordinator.stop.remote(since=since), timeout=timeout_s))
        except Exception as e:  # noqa: BLE001 - killing the coordinator below releases everything
            log.warning("job %s: stop did not finish cleanly (%s); killing its coordinator", job_id, e)
        self.live.finish(job_id, JobStatus.STOPPED)
        return self.get(job_id)

    def _stop_queued(self, job: JobRecord) -> None:
        """A job stopped in the queue that ran before (the service's restart interrupted it): as a stop of a running
        job, its model is that of its latest checkpoint and its steps and rows end there (the rows the store had not
        read yet come from the metrics log beside the checkpoints). A job that never ran has none of these."""
        config = parse_spec(job.spec)
        root = self.checkpoint_root(job.job_id, config)
        if steps_logged(root) is None:
            return
        try:
            step = ray.get(_export_latest.remote(config, str(root), str(self.model_path(job.job_id))), timeout=300)
        except Exception as e:  # noqa: BLE001 - the job is stopped all the same, without a model
            log.warning("job %s: stopped in the queue; no model from its checkpoints (%s)", job.job_id, e)
            return
        if step is None:
            return
        if self.store.get(job.job_id) is None:  # deleted meanwhile: its files go with it
            shutil.rmtree(self.model_path(job.job_id).parent, ignore_errors=True)
            return
        self.store.add_metrics(job.job_id, [r for r in read_metrics_log(root) if r["step"] < step])
        self.store.drop_metrics_from(job.job_id, step)
        self.store.update(job.job_id, step=step)

    def model_file(self, job_id: str) -> Path:
        """The trained model of an ended job (SUCCEEDED or STOPPED after at least one step)."""
        job = self.get(job_id)
        if job.status not in (JobStatus.SUCCEEDED, JobStatus.STOPPED):
            raise JobConflict(f"job {job_id} is {job.status}; its model is written when it ends SUCCEEDED or "
                              "STOPPED")
        path = self.model_path(job_id)
        if not path.is_file():
            raise JobConflict(f"job {job_id} ended without a model (it stopped before finishing a step, or was "
                              "stopped while a step hung)")
        return path

    def events(self, job_id: str) -> builtins.list[dict]:
        return self.get(job_id).events

    def inject_fault(self, job_id: str, kind: str, rank: int, at_step: int) -> dict:
        """Schedule a fault drill in a running job (the API allows it only under --allow-fault-injection)."""
        job = self.get(job_id)
        coordinator = self.live.coordinator(job_id)
        if job.status is not JobStatus.RUNNING or coordinator is None:
            raise JobConflict(f"job {job_id} is {job.status}; a drill needs a RUNNING job")
        workers = len(job.ranks) or make_plan(parse_spec(job.spec)).world_size
        if rank >= workers:
            raise RankNotFound(f"job {job_id} has no rank {rank}; its ranks are 0 to {workers - 1}")
        ray.get(coordinator.inject.remote(kind, rank, at_step), timeout=30)
        return {"job_id": job_id, "kind": kind, "rank": rank, "at_step": at_step}

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
        shutil.rmtree(self.model_path(job_id).parent, ignore_errors=True)
        shutil.rmtree(self.checkpoint_root(job_id, parse_spec(job.spec)), ignore_errors=True)

    def shutdown(self) -> None:
        """Stop admitting and following. Live jobs go on (detached), or checkpoint and are queued again within
        a few seconds. Waiting jobs stay queued in the store for the next start."""
        self._stopping.set()
        self._wake.set()
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
