"""Admission: the head of the queue starts when its whole gang fits the free resources (`service.admission.queue`
decides).

The admission thread's body (`Admission.admit_queued`) reserves the head's placement group (ready at once, or given
back and tried again later: another job may have taken the resources in between), and only then starts the
job's Coordinator with it, on the service's own node, and hands it to `LiveJobs` to follow. A waiting job holds
no Ray process; the last free resources read are kept for the queue's view of what each job waits for. A job its
owner's quota holds back gets an event saying so, once per wait.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from trainyard.actors.coordinator import Coordinator, JobStorage
from trainyard.actors.journal import steps_logged
from trainyard.actors.naming import coordinator_name, placement_group_name
from trainyard.actors.state import JobStatus
from trainyard.parallel.config import JobConfig, RuleError
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.spec import parse_spec, spec_to_dict
from trainyard.service.admission import queue
from trainyard.service.errors import Calibrating
from trainyard.service.following.live_jobs import LiveJobs
from trainyard.service.paths import JobPaths
from trainyard.service.ray_runtime import cluster_resources, free_resources
from trainyard.service.store import JobRecord
from trainyard.service.tenancy import quota

log = logging.getLogger("trainyard.manager")

RESERVE_TIMEOUT_S = 5.0
"""How long admission waits for a placement group that fitted the free resources (another job may have
taken them in between); then it is given back and the queue tried again."""


class Admission:
    def __init__(self, live: LiveJobs, paths: JobPaths, resume_point: Callable[[JobConfig], tuple[str, int] | None],
                 detach_jobs: bool, choose_layout: Callable[[JobConfig], JobConfig] = lambda config: config,
                 quotas: queue.Quotas = lambda _: quota.NO_QUOTA,
                 start_client: Callable[[str, Plan, PlacementGroup], None] | None = None):
        """`choose_layout`: `parallel: auto` resolved (raises Calibrating while the costs are being measured);
        `quotas`: each user's (`service.tenancy.users`); `start_client`: builds an admitted Tinker training client's
        ranks in its reserved group (`service.tinker.TinkerClients.admitted`; a job of kind `tinker` has no
        coordinator)."""
        self.live, self.store, self.paths = live, live.store, paths
        self.start_client = start_client
        self.quotas = quotas
        self.resume_point = resume_point
        self.choose_layout = choose_layout
        self.detach_jobs = detach_jobs
        self.free: list[dict[str, float]] = []
        """Each node's free resources, as last read (the queue's view shows what a job waits for against it)."""

    def waiting(self) -> tuple[list[JobRecord], dict[str, dict[str, float]]]:
        """The queue in admission order (`queue.fair_order`), and what each user's live jobs hold."""
        live = self.store.live_needs()
        held = quota.usage(live)
        return queue.fair_order(self.store.queue(), Counter(owner for _, owner, _ in live)), held

    def admit_queued(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """Admit jobs from the head of the queue for as long as the head fits."""
        while not stopping():
            waiting, held = self.waiting()
            unplanned = [job for job in waiting if not queue.planned(job)]
            for job in unplanned:  # until the costs are known (one measurement serves them all)
                if not self.live.guarded(job.job_id, self._plan, job):
                    break
            if unplanned:
                waiting, held = self.waiting()
            self._say_why_held(waiting, held)
            self.free = free_resources() if waiting else self.free
            head = queue.next_to_admit(waiting, self.free, held, self.quotas)
            if head is None or not self.live.guarded(head.job_id, self._admit, head):
                return

    def _say_why_held(self, waiting: list[JobRecord], held: dict[str, dict[str, float]]) -> None:
        """An event on each job its owner's quota holds back, unless its last event says so already."""
        for job in waiting:
            reason = queue.held_by_quota(job, held, self.quotas)
            if reason is not None and (not job.events or job.events[-1].get("kind") != "waiting_for_quota"):
                self.store.add_events(job.job_id, [{"time": time.time(), "kind": "waiting_for_quota",
                                                    "cause": reason}])

    def _plan(self, job: JobRecord) -> bool:
        """A `parallel: auto` job submitted while the costs were measured: its layout chosen once they are known
        (True), or not yet (False). A job no layout fits fails, saying why."""
        config = parse_spec(job.spec)
        try:
            chosen = self.choose_layout(config)
        except Calibrating:
            return False
        try:
            plan = make_plan(chosen, cluster_resources())
        except RuleError as e:
            self.live.finish(job.job_id, JobStatus.FAILED, f"no layout of this job runs on this cluster: {e}")
            return True
        beyond = self.quotas(job.owner).never_fits(quota.charge(plan))
        if beyond is not None:  # what a submit refuses with a 422 when the layout is known then
            self.live.finish(job.job_id, JobStatus.FAILED, f"resources: {beyond}")
            return True
        if self.store.set_plan(job.job_id, spec_to_dict(chosen), quota.needs(plan)):
            layout = {"dp": plan.dp, "pp": plan.pp, "tp": plan.tp, "ep": plan.ep, "world_size": plan.world_size}
            self.store.add_events(job.job_id, [{"time": time.time(), "kind": "planned", "layout": layout,
                                                "cause": "the node type's costs are measured: the planner chose "
                                                         "the layout"}])
            log.info("job %s planned (world size %d)", job.job_id, plan.world_size)
        return True

    def _admit(self, job: JobRecord) -> bool:
        """Reserve the job's placement group and start its coordinator; False if the resources were taken
        in the meantime (the job stays queued)."""
        try:
            config = parse_spec(job.spec)
            plan = make_plan(config, cluster_resources())
            if job.kind == "tinker":
                return self._admit_client(job, plan)
            root = self.paths.checkpoint_root(job.job_id, config)
            # A job the service's restart interrupted goes on from its own (hashed by the coordinator), the latest
            # with every step before it in the coordinator's metrics log (`steps_logged`).
            own = checkpoint.latest_valid(root, at_most=steps_logged(root), hashes=False)
            resume = (str(own.directory), own.step) if own else self.resume_point(config)
            latest_of_another = own is None and config.resume_from is not None and config.resume_from.step is None
            storage = JobStorage(checkpoint_root=str(root), model_path=str(self.paths.model_path(job.job_id)),
                                 resume=resume, resume_falls_back=latest_of_another, events=tuple(job.events))
        except RuleError as e:  # e.g. the cluster lost nodes since the job was queued
            self.live.finish(job.job_id, JobStatus.FAILED, f"the job can no longer run on this cluster: {e}")
            return True
        lifetime = "detached" if self.detach_jobs else None
        pg = placement_group(plan.bundles(), strategy="PACK", name=placement_group_name(job.job_id),
                             lifetime=lifetime)
        if not pg.wait(RESERVE_TIMEOUT_S):
            remove_placement_group(pg)
            return False
        with self.live.lock:
            if not self.store.claim(job.job_id):  # stopped or deleted while the group was reserved
                remove_placement_group(pg)
                return True
            # Ray restarts a coordinator whose process dies, as often as the job may fail (see actors.coordinator).
            # On the service's own node, the node the user keeps up: a worker node may come and go, and a
            # coordinator lost with its node takes every rank with it (the ranks are its actors). A hard
            # affinity: a soft one let Ray place it on another node with room even while the service's node had
            # room too (seen on a two-node `ray.cluster_utils.Cluster`), where the node's loss then killed
            # the coordinator before the ranks and the shrink never came. It needs no resources (num_cpus=0),
            # so it always fits there; should that node die, the service is gone with it.
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            coordinator = Coordinator.options(  # type: ignore[attr-defined]  # a @ray.remote class
                name=coordinator_name(job.job_id), lifetime=lifetime, max_restarts=config.fault.max_failures,
                scheduling_strategy=here).remote(job.job_id, plan, pg, storage)
            self.live.add(job.job_id, coordinator, pg, job.step)
        coordinator.start.remote()  # a coordinator that cannot start shows up in the next poll
        log.info("job %s admitted (world size %d)", job.job_id, plan.world_size)
        return True

    def _admit_client(self, job: JobRecord, plan: Plan) -> bool:
        """A Tinker training client's turn: its group reserved as a job's (never detached: its actor is the
        service's), then its ranks built by `start_client`; False if the resources were taken meanwhile."""
        pg = placement_group(plan.bundles(), strategy="PACK", name=placement_group_name(job.job_id))
        if not pg.wait(RESERVE_TIMEOUT_S):
            remove_placement_group(pg)
            return False
        if self.start_client is None or not self.store.claim(job.job_id):  # unloaded while the group was reserved
            remove_placement_group(pg)
            return True
        self.start_client(job.job_id, plan, pg)
        log.info("tinker client %s admitted (world size %d)", job.job_id, plan.world_size)
        return True
