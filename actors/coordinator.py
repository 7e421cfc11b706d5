"""The Coordinator actor: one per job. It owns the job's placement group, workers and step loop.

Life of a job, as the coordinator drives it (the service's admission loop has already reserved the job's
placement group, all or nothing, and hands it over ready; the service removes it when the job ends):
  PENDING   the coordinator's process is starting
  RUNNING   create one Worker per rank on its bundle, rendezvous, then per step send each worker its
            micro-batch sample ids (one Ray call per worker per step, queued one step ahead) and record the
            step's metrics
  RECOVERING  a step failed: the ranks are brought back from the latest checkpoint (then RUNNING again)
  SUCCEEDED / STOPPED / FAILED   once the workers and the placement group are released

It is an async actor so that `poll` and `stop` are answered while a step runs. A step fails when a worker
raises, dies, or hangs: no answer within `fault.hang_factor` x the median of the recent steps (at least
`fault.hang_floor_s`; `fault.step_timeout_s` always). Up to `fault.max_failures` times the job then
RECOVERS (RUNNING -> RECOVERING -> RUNNING, `_recover`): ranks that raised are reset and reused, the others
killed and replaced on their bundle, and every rank restarts from the latest checkpoint, so the run goes on
exactly as it would have. The next failure fails the job with every cause, and every rank is killed, so a
peer blocked in a collective cannot hang. Each failure, recovery (with its time) and checkpoint is an
event. When a rank's process dies its peers' collectives fail too, often before Ray reports the death: the
error names the rank that died, not the first peer that noticed.

The coordinator's own death is a failure too: the service creates it with Ray `max_restarts =
fault.max_failures`, its workers die with it (Ray fate-shares actors with their owner), and Ray starts it
again with the same arguments. The new incarnation reads what its predecessor wrote beside the checkpoints
(`coordinator.json`: events and causes, rewritten when they change; `metrics.jsonl`: a row appended per
step, so that no step's row is lost between two polls of the service), records the failure, and recovers
like any other: new workers on the same placement group, the latest checkpoint, on. It starts on the service's
next poll, since nobody calls `start` again.
State changes happen in `_set_state` only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray.util.metrics import Gauge
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.naming import coordinator_name, placement_group_name, worker_name
from actors.state import Event, JobStatus, next_state
from actors.worker import Worker
from api.spec import spec_to_dict
from parallel import checkpoint
from parallel.config import JobConfig
from parallel.data import global_batch_ids, open_dataset, rank_share
from parallel.export import export_model
from parallel.plan import Plan, PlanError, can_move_in_memory, make_plan, resized

log = logging.getLogger("trainyard.coordinator")


class StepFailed(RuntimeError):
    """A call that failed on some ranks: which ones died, raised, or never answered (hung or blocked)."""

    def __init__(self, message: str, *, dead: tuple[int, ...] = (), raised: tuple[int, ...] = (),
                 pending: tuple[int, ...] = (), blamed: tuple[int, ...] = ()):
        super().__init__(message)
        self.dead, self.raised, self.pending, self.blamed = dead, raised, pending, blamed


@dataclass(frozen=True)
class JobStorage:
    """Where a job's checkpoints and trained model are written (the service decides), and what it resumes."""

    checkpoint_root: str
    model_path: str
    resume: tuple[str, int] | None = None
    """(checkpoint directory, its step) to start from."""
    events: tuple[dict, ...] = ()
    """The job's events so far (a job relaunched after the service came back keeps its history)."""


def checkpoint_info(config: JobConfig) -> dict:
    """What a checkpoint's manifest records of the job: what a job resuming from it must match."""
    spec = spec_to_dict(config)
    return {"model": spec["model"], "optimizer": spec["optimizer"], "seed": config.seed}


STOP_GRACE_S = 8.0
"""How long a stop waits for the step under way, the final checkpoint and the export before it cancels
(within the service's 10 s shutdown bound)."""
RESET_TIMEOUT_S = 10.0
"""How long a rank that raised may take to leave its process groups before it is replaced instead."""
HANG_WINDOW = 20
HANG_MIN_STEPS = 3
"""Steps recorded before the hang detector trusts their median (the first steps include warm-up)."""
JOURNAL, METRICS_LOG = "coordinator.json", "metrics.jsonl"
"""The coordinator's state that outlives its process, in the job's checkpoint directory."""
GROW_RESERVE_S = 10.0
"""How long a resize that adds ranks waits for their resources before it is refused."""
DEATH_GRACE_S = 5.0
"""After a rank fails, how long to wait for the other ranks' results of the same call, so that a rank
whose process died is found among them (Ray reports a death a moment after the peers see broken pipes)."""


_GAUGES = {
    "step": Gauge("trainyard_step", "Last finished step", tag_keys=("job_id",)),
    "loss": Gauge("trainyard_loss", "Training loss of the last step", tag_keys=("job_id",)),
    "tokens_per_s": Gauge("trainyard_tokens_per_s", "Training throughput", tag_keys=("job_id",)),
    "step_time_s": Gauge("trainyard_step_time_s", "Wall time of the last step", tag_keys=("job_id",)),
    "bubble_fraction": Gauge("trainyard_bubble_fraction", "Measured pipeline bubble of the last step",
                             tag_keys=("job_id",)),
}
_STAGE_GAUGES = {
    "stage_forward_s": Gauge("trainyard_stage_forward_s", "Forward time of a pipeline stage in the last step",
                             tag_keys=("job_id", "stage")),
    "stage_backward_s": Gauge("trainyard_stage_backward_s", "Backward time of a pipeline stage in the last step",
                              tag_keys=("job_id", "stage")),
}
_MOE_GAUGES = {
    "aux_loss": Gauge("trainyard_moe_aux_loss", "Load-balancing loss of an MoE layer in the last step (1: balanced)",
                      tag_keys=("job_id", "layer")),
    "z_loss": Gauge("trainyard_moe_z_loss", "Router z-loss of an MoE layer in the last step",
                    tag_keys=("job_id", "layer")),
    "dropped_fraction": Gauge("trainyard_moe_dropped_fraction",
                              "Fraction of an MoE layer's token assignments over capacity in the last step",
                              tag_keys=("job_id", "layer")),
}
_EXPERT_LOAD = Gauge("trainyard_moe_expert_load", "Tokens routed to an expert of an MoE layer in the last step",
                     tag_keys=("job_id", "layer", "expert"))


@ray.remote(num_cpus=0)
class Coordinator:
    def __init__(self, job_id: str, plan: Plan, pg: PlacementGroup, storage: JobStorage):
        """`pg` is the job's placement group, already reserved: one bundle per tensor-parallel group;
        `storage` says where checkpoints and the trained model go, and which checkpoint to start from."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.job_id, self.plan, self.pg, self.storage = job_id, plan, pg, storage
        self.start_step = storage.resume[1] if storage.resume else 0
        self.model: dict | None = None
        """The exported model (path, step) once written."""
        self._stop_requested = self._suspend = False
        self.events: list[dict] = list(storage.events)
        """Failures, recoveries and checkpoints, oldest first (GET /api/jobs/{id}/events)."""
        self.causes: list[str] = []
        self.restarted = _was_restarted()
        """Ray restarted this actor after its process died: the job recovers from its journal."""
        # What an earlier coordinator of this job recorded that the service may not have seen: the rows of the
        # steps before the one this starts from, and events (e.g. checkpoints written after the last poll).
        root = Path(storage.checkpoint_root)
        journal, self.metrics = read_journal(root), read_metrics_log(root)
        self.events = merge_events(self.events, journal.get("events", []))
        if self.restarted:
            self.causes = journal.get("causes", [])
            self._last_step = self.metrics[-1]["step"] + 1 if self.metrics else self.start_step
            self._last_alive = _mtime(root / METRICS_LOG) or time.time()
        else:
            self.metrics = [row for row in self.metrics if row["step"] < self.start_step]
        self.drills: list[dict] = []
        """Fault drills still to run: kind, rank, at_step."""
        self._failed_at: float | None = None
        self._upcoming: list[ray.ObjectRef] = []
        self._step_started = time.time()
        """When the step being waited for became the one waited for (the last step's results came back)."""
        self.status = JobStatus.PENDING
        self.error: str | None = None
        self.workers: list = []
        self.ranks: list[dict] = []
        """Where each rank runs (rank, name, node, pid, device), once the workers are set up."""
        self._task: asyncio.Task | None = None
        self.slots: dict[tuple[int, int], tuple[PlacementGroup, int]] = {
            (plan.coords(r).pp, plan.coords(r).dp): (pg, plan.bundle_of(r)) for r in range(plan.world_size)}
        """Where each tensor-parallel group (pp, dp) runs: a placement group and its bundle."""
        self.spare: list[tuple[PlacementGroup, int]] = []
        """Reserved bundles no rank uses (after a shrink, or reserved for a growth under way)."""
        self.grown: list[PlacementGroup] = []
        """Placement groups this coordinator reserved to grow (the admitted one is the service's)."""
        self._resize_to: tuple[Plan, str, float] | None = None
        """A resize to do at the next step boundary: the new plan, why, when it was asked for."""

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def poll(self, since: int = 0) -> dict:
        """Status, error and the metrics rows of steps >= `since`. A restarted coordinator starts here."""
        if self.restarted:
            await self.start()
        return self._report(since)

    def _report(self, since: int) -> dict:
        return {
            "status": self.status.value,
            "error": self.error,
            "step": self.metrics[-1]["step"] + 1 if self.metrics else self.start_step,
            "model": self.model,
            "events": self.events,
            "metrics": [row for row in self.metrics if row["step"] >= since],
            "actors": self.actor_names(),
            "ranks": self.ranks,
        }

    async def stop(self, grace_s: float = STOP_GRACE_S, suspend: bool = False) -> dict:
        """End the run at the next step boundary, with a final checkpoint and the model exported; if that
        takes longer than `grace_s` (a hung step), cancel it. Returns the final poll. `suspend`: the service is
        going down, the job is not over: the final checkpoint is what it goes on from later; no model."""
        if self._task is not None and not self._task.done():
            self._stop_requested, self._suspend = True, suspend
            done, _ = await asyncio.wait({self._task}, timeout=grace_s)
            if not done:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        return self._report(self.start_step)

    async def scale(self, dp: int, reason: str = "request") -> dict:
        """Go to `dp` data-parallel replicas at the next step boundary (see `_resize`); the resources of added
        ranks are reserved first. Returns the new layout, or why the resize is refused now."""
        if self.status is not JobStatus.RUNNING or self._resize_to is not None:
            state = "resizing already" if self._resize_to is not None else str(self.status)
            return {"refused": f"job {self.job_id} is {state}; only a RUNNING job can be resized"}
        limits = self.plan.dp_range
        if limits is not None and not limits[0] <= dp <= limits[1]:
            raise PlanError("parallel.dp", f"dp={dp} is outside the job's range parallel.dp = {{min: {limits[0]}, "
                                  f"max: {limits[1]}}}")
        new = replace(make_plan(resized(self.plan.config, dp)), dp_range=limits)
        layout = {"dp": new.dp, "microbatches": new.microbatches, "world_size": new.world_size}
        if dp == self.plan.dp:
            return layout
        problem = await self._reserve(sum(1 for key in self._keys(new) if key not in self.slots))
        if problem:
            return {"refused": problem}
        self._resize_to = (new, reason, time.time())
        return layout

    async def inject(self, kind: str, rank: int, at_step: int) -> None:
        """A fault drill: `kind` happens to `rank` when it starts step `at_step` (or the first step after)."""
        self.drills.append({"kind": kind, "rank": rank, "at_step": at_step})

    async def add_event(self, event: dict) -> None:
        """An event the service saw (e.g. it reattached to this job after a restart)."""
        self.events.append(event)
        self._write_journal()

    def actor_names(self) -> list[str]:
        return [coordinator_name(self.job_id)] + [
            worker_name(self.job_id, self.plan.worker_name(r)) for r in range(self.plan.world_size)
        ]

    def _set_state(self, event: Event) -> None:
        new = next_state(self.status, event)
        log.info("job %s: %s -> %s (%s)", self.job_id, self.status, new, event)
        self.status = new

    async def _run(self) -> None:
        outcome, grower = Event.FINISHED, None
        try:
            self._set_state(Event.RESOURCES_READY)
            if self.restarted:
                await self._recover_from_own_death()
            else:
                await self._start_workers()
                await self._load(self.storage.resume)
            if self.plan.dp_range is not None:
                grower = asyncio.get_running_loop().create_task(self._grow_when_possible())
            while True:
                try:
                    await self._train()
                    if self._resize_to is None or self.start_step >= self.plan.config.steps or self._stop_requested:
                        break
                    await self._resize()
                except StepFailed as failure:
                    if self.plan.dp_range is not None and not self._stop_requested and await self._node_lost(failure):
                        await self._ride_node_loss(failure)
                        continue
                    self.causes.append(str(failure))
                    if len(self.causes) > self.plan.config.fault.max_failures or self._stop_requested:
                        raise StepFailed(self._all_causes(), blamed=failure.blamed) from None
                    await self._recover(failure)
            if self._stop_requested:
                outcome = Event.STOP_REQUESTED
        except asyncio.CancelledError:
            outcome = Event.STOP_REQUESTED
        except Exception as e:  # noqa: BLE001 - any failure ends the job with its traceback
            outcome = Event.ERROR
            self.error = str(e) if isinstance(e, StepFailed) else traceback.format_exc()
        finally:
            if grower is not None:
                grower.cancel()
            self._release()
            self._set_state(outcome)

    async def _new_worker(self, rank: int):
        plan = self.plan
        c = plan.coords(rank)
        pg, bundle = self.slots[(c.pp, c.dp)]
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
        options = {"name": worker_name(self.job_id, plan.worker_name(rank)), "num_cpus": plan.cpus_per_worker,
                   "num_gpus": plan.gpus_per_worker, "scheduling_strategy": strategy}
        for _ in range(50):  # the name of a rank just killed (a shrink, a recovery) is free a moment later
            try:
                return Worker.options(**options).remote(self.job_id, rank, int(plan.cpus_per_worker))
            except ValueError:
                await asyncio.sleep(0.1)
        return Worker.options(**options).remote(self.job_id, rank, int(plan.cpus_per_worker))

    async def _start_workers(self) -> None:
        """Create a worker for every rank that has none, then rendezvous and set every rank up."""
        plan = self.plan
        self.workers = [self.workers[r] if r < len(self.workers) and self.workers[r] is not None
                        else await self._new_worker(r) for r in range(plan.world_size)]
        timeout = plan.config.fault.step_timeout_s
        addr, port = (await self._call_all([self.workers[0].address.remote()], "rendezvous", timeout))[0]
        setups = await self._call_all([w.setup.remote(plan, addr, port, r) for r, w in enumerate(self.workers)],
                                      "setup", timeout)
        self.ranks = [{**info, "name": plan.worker_name(info["rank"])} for info in setups]

    @staticmethod
    def _keys(plan: Plan) -> set[tuple[int, int]]:
        return {(plan.coords(r).pp, plan.coords(r).dp) for r in range(plan.world_size)}

    async def _reserve(self, count: int) -> str | None:
        """Make sure `count` spare bundles exist, reserving a placement group for the missing ones; None when
        they do, else why not."""
        missing = count - sum(1 for slot in self.spare if _placed(slot))
        if missing <= 0:
            return None
        pg = placement_group([dict(self.plan.gang.bundle) for _ in range(missing)], strategy="PACK",
                             name=f"{placement_group_name(self.job_id)}-grow{len(self.grown)}", lifetime="detached")
        try:
            await asyncio.wait_for(pg.ready(), GROW_RESERVE_S)
        except (TimeoutError, ray.exceptions.RayError):
            remove_placement_group(pg)
            return (f"the cluster has no free resources for {missing} more groups of {self.plan.gang.bundle} "
                    f"(waited {GROW_RESERVE_S:.0f} s)")
        self.grown.append(pg)
        self.spare += [(pg, i) for i in range(missing)]
        return None

    def _move_slots(self, new: Plan) -> None:
        """Give the slots of the tensor-parallel groups `new` drops back, and take spare ones for those it adds;
        a grown placement group none of whose bundles is in use any more is given back to Ray."""
        keys = self._keys(new)
        self.spare += [slot for key, slot in self.slots.items() if key not in keys]
        self.slots = {key: slot for key, slot in self.slots.items() if key in keys}
        self.spare.sort(key=lambda slot: not _placed(slot))  # the bundles Ray has placed first
        for key in sorted(keys - set(self.slots)):
            self.slots[key] = self.spare.pop(0)
        for pg in list(self.grown):
            if all(p is not pg for p, _ in self.slots.values()):
                self.spare = [slot for slot in self.spare if slot[0] is not pg]
                self.grown.remove(pg)
                remove_placement_group(pg)

    async def _resize(self) -> None:
        """Go to the layout `scale` asked for, between two steps: ranks whose (pp, tp, dp) coordinates remain
        keep their actor (and, when `can_move_in_memory`, their state: new ranks get it by broadcast from
        data-parallel rank 0), removed ranks are killed, added ones created on their reserved bundles; every
        rank joins new process groups. Otherwise the state goes through a checkpoint of this step."""
        new, reason, asked = self._resize_to
        self._resize_to = None
        old, step, cfg = self.plan, self.start_step, self.plan.config
        self._set_state(Event.RESIZE)
        began, timeout = time.time(), cfg.fault.step_timeout_s
        in_memory = can_move_in_memory(old, new)
        kept = {r: new.rank_of(c.pp, c.tp, c.dp) for r in range(old.world_size) if (c := old.coords(r)).dp < new.dp}
        if in_memory:
            await self._call_all([self.workers[r].keep_state.remote() for r in kept], "keeping the state", timeout)
        else:
            root = self.storage.checkpoint_root
            await self._call_all([w.final_checkpoint.remote(root, step, checkpoint_info(cfg), self._saved_at(step))
                                  for w in self.workers], f"the checkpoint of step {step} for a resize", timeout)
            await self._call_all([self.workers[r].reset.remote() for r in kept], "leaving the process groups",
                                 timeout)
        for rank, worker in enumerate(self.workers):
            if rank not in kept:
                ray.kill(worker, no_restart=True)
        workers = [None] * new.world_size
        for rank, new_rank in kept.items():
            workers[new_rank] = self.workers[rank]
        self.plan, self.workers = new, workers
        self._move_slots(new)
        await self._start_workers()
        if in_memory:
            grew = new.dp > old.dp
            await self._call_all([w.adopt_state.remote(step, new.rank_of(new.coords(r).pp, new.coords(r).tp, 0)
                                                       if grew else None) for r, w in enumerate(self.workers)],
                                 "moving the state", timeout)
        else:
            await self._load((str(checkpoint.step_dir(Path(self.storage.checkpoint_root), step)), step))
        self._resize_event(old, new, reason, asked, began, "memory" if in_memory else "checkpoint")
        self._set_state(Event.RESIZED)

    def _resize_event(self, old: Plan, new: Plan, reason: str, asked: float, began: float, moved: str) -> None:
        layout = lambda p: {"dp": p.dp, "microbatches": p.microbatches, "world_size": p.world_size}  # noqa: E731
        self.events.append({"time": began, "kind": "resize", "reason": reason, "step": self.start_step,
                            "from": layout(old), "to": layout(new), "moved": moved,
                            "paused_s": time.time() - began, "waited_s": began - asked})
        self._write_journal()
        log.info("job %s: resized dp %d -> %d at step %d (%s, state moved through %s)", self.job_id, old.dp,
                 new.dp, self.start_step, reason, moved)

    def _saved_at(self, step: int) -> bool:
        """Whether the step before `step` wrote the checkpoint of `step` already."""
        cfg = self.plan.config
        return cfg.checkpoint.every > 0 and step % cfg.checkpoint.every == 0 and step < cfg.steps

    async def _load(self, point: tuple[str, int] | None) -> None:
        if point is None:
            return
        directory, step = point
        await self._call_all([w.load_checkpoint.remote(directory, step) for w in self.workers],
                             f"loading the checkpoint of step {step}", self.plan.config.fault.step_timeout_s)

    async def _recover(self, failure: StepFailed) -> None:
        """Bring the job back after a failed step: ranks that raised are reset and reused, ranks that died
        or never answered (hung, or blocked on a dead peer) are replaced on their bundle; then every rank
        rendezvous anew and loads the latest checkpoint (else the resume point, else the initial weights),
        and training goes on after it."""
        self._set_state(Event.FAILURE)
        restore = self._record_failure(failure)
        await self._tear_down(failure)
        await self._start_workers()
        await self._load(restore)
        self.metrics = [row for row in self.metrics if row["step"] < self.start_step]
        self._set_state(Event.RECOVERED)

    def _record_failure(self, failure: StepFailed) -> tuple[str, int] | None:
        blamed = list(failure.blamed)
        return self._failure_event(str(failure), time.time(), time.time() - self._step_started, blamed,
                                   sorted({self._rank_info(r).get("node", "") for r in blamed}),
                                   self.metrics[-1]["step"] + 1 if self.metrics else self.start_step)

    async def _tear_down(self, failure: StepFailed) -> None:
        """After a failed step: ranks that raised are reset (and kept), every other rank is killed."""
        for ref in self._upcoming:  # the step queued ahead: not to run on the ranks kept
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - already run or gone
                pass
        reusable = set(failure.raised) - set(failure.dead) - set(failure.pending)
        for rank, worker in enumerate(self.workers):  # first, so that no kept rank waits on them
            if rank not in reusable and worker is not None:
                ray.kill(worker, no_restart=True)
                self.workers[rank] = None
        resets = {r: self.workers[r].reset.remote() for r in reusable}
        for rank, ref in resets.items():
            try:
                await asyncio.wait_for(asyncio.ensure_future(ref), RESET_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a rank that cannot even reset is replaced
                ray.kill(self.workers[rank], no_restart=True)
                self.workers[rank] = None

    # --- elasticity (parallel.dp: {min, max}) ----------------------------------------------------

    async def _node_lost(self, failure: StepFailed) -> bool:
        """Whether a rank that died was on a node Ray has lost (it may take Ray a moment to say so)."""
        nodes = {self._rank_info(r).get("node_id") for r in failure.dead} - {None}
        for _ in range(10):
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if nodes - alive:
                return True
            await asyncio.sleep(0.3)
        return False

    async def _ride_node_loss(self, failure: StepFailed) -> None:
        """An elastic job lost a node: wait up to fault.node_grace_s for Ray to place its bundles elsewhere
        (then recover as usual), else shrink to the replicas whose bundles are all placed, from the latest
        checkpoint. Not counted against fault.max_failures: riding node churn is what elastic jobs are for."""
        self._set_state(Event.FAILURE)
        restore = self._record_failure(failure)
        began, old = time.time(), self.plan
        await self._tear_down(failure)
        deadline = time.monotonic() + old.config.fault.node_grace_s
        while time.monotonic() < deadline and not all(_placed(slot) for slot in self.slots.values()):
            await asyncio.sleep(0.5)
        lost = {dp for (_, dp), slot in self.slots.items() if not _placed(slot)}
        if lost:
            kept = [d for d in range(old.dp) if d not in lost]
            size = self._largest_size(len(kept))
            if size is None:
                raise StepFailed(f"{failure}\nA node was lost and its resources did not come back within "
                                 f"fault.node_grace_s={old.config.fault.node_grace_s:g} s; the {len(kept)} replicas "
                                 f"left are fewer than parallel.dp.min={old.dp_range[0]}")
            self._regroup(kept[:size])
        await self._start_workers()
        await self._load(restore)
        self.metrics = [row for row in self.metrics if row["step"] < self.start_step]
        if lost:
            self._resize_event(old, self.plan, "node lost", began, began, "checkpoint")
        self._set_state(Event.RECOVERED)

    def _largest_size(self, at_most: int) -> int | None:
        """The largest data-parallel size <= at_most within the job's range that the global batch allows."""
        for size in range(min(at_most, self.plan.dp_range[1]), self.plan.dp_range[0] - 1, -1):
            try:
                make_plan(resized(self.plan.config, size))  # every rule, e.g. ep must divide dp
                return size
            except PlanError:
                continue
        return None

    def _regroup(self, replicas: list[int]) -> None:
        """Go on with these data-parallel replicas (renumbered 0, 1, ...), their workers and bundles; the rest
        are killed and their bundles kept spare (Ray places them again if their node comes back)."""
        old = self.plan
        new = replace(make_plan(resized(old.config, len(replicas))), dp_range=old.dp_range)
        workers: list = [None] * new.world_size
        slots = {}
        for i, d in enumerate(replicas):
            for p in range(old.pp):
                slots[(p, i)] = self.slots.pop((p, d))
                for t in range(old.tp):
                    workers[new.rank_of(p, t, i)] = self.workers[old.rank_of(p, t, d)]
                    self.workers[old.rank_of(p, t, d)] = None
        for worker in self.workers:
            if worker is not None:
                ray.kill(worker, no_restart=True)
        self.spare += list(self.slots.values())
        self.plan, self.workers, self.slots = new, workers, slots

    async def _grow_when_possible(self) -> None:
        """Elastic jobs below their max: every fault.grow_interval_s, grow into the resources that are free
        (bundles of a lost node that Ray placed again count too)."""
        while True:
            await asyncio.sleep(self.plan.config.fault.grow_interval_s)
            if self.status is not JobStatus.RUNNING or self._resize_to is not None:
                continue
            free = ray.available_resources()
            bundle, per_replica = self.plan.gang.bundle, self.plan.pp
            fits = min(int(free.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0)
            groups = fits + sum(1 for slot in self.spare if _placed(slot))
            size = self._largest_size(self.plan.dp + groups // per_replica)
            if size is not None and size > self.plan.dp:
                answer = await self.scale(size, "resources appeared")
                if "refused" in answer:
                    log.info("job %s: no growth to dp=%d now: %s", self.job_id, size, answer["refused"])

    async def _recover_from_own_death(self) -> None:
        """The first thing a restarted coordinator does: its workers died with its old process (their owner),
        so every rank is new; the latest checkpoint is where it goes on from."""
        self._set_state(Event.FAILURE)
        cause = (f"the coordinator died (its process exited after step {self._last_step}; Ray restarted it, "
                 f"restart {len(self.causes) + 1} of fault.max_failures={self.plan.config.fault.max_failures})")
        self.causes.append(cause)
        if len(self.causes) > self.plan.config.fault.max_failures:
            raise StepFailed(self._all_causes())
        restore = self._failure_event(cause, self._last_alive, time.time() - self._last_alive, [], [],
                                      self._last_step)
        self.metrics = [row for row in self.metrics if row["step"] < self.start_step]
        await self._start_workers()
        await self._load(restore)
        self._set_state(Event.RECOVERED)

    def _failure_event(self, cause: str, failed_at: float, waited_s: float, ranks: list[int], nodes: list[str],
                       step: int) -> tuple[str, int] | None:
        """Record a failure at `step` and choose where to go on from: the latest valid checkpoint, else the
        resume point, else the start. Recovery time counts from `failed_at`."""
        found = checkpoint.latest_valid(Path(self.storage.checkpoint_root))
        restore = (str(found.directory), found.step) if found else self.storage.resume
        restore_step = restore[1] if restore else 0
        self._failed_at, self.start_step = failed_at, restore_step
        self.events.append({
            "time": failed_at, "kind": "failure", "cause": cause, "ranks": ranks, "waited_s": waited_s,
            "nodes": nodes, "step": step, "steps_lost": max(0, step - restore_step), "restore_step": restore_step,
            "failure": len(self.causes),
        })
        self._write_journal()
        log.warning("job %s: failure %d (%s); recovering from step %d", self.job_id, len(self.causes),
                    cause.splitlines()[0], restore_step)
        return restore

    def _write_journal(self) -> None:
        write_journal(Path(self.storage.checkpoint_root), {"events": self.events, "causes": self.causes})

    def _all_causes(self) -> str:
        if len(self.causes) == 1:
            return self.causes[0]
        return "\n".join(f"failure {i} of {len(self.causes)}: {cause}" for i, cause in enumerate(self.causes, 1))

    async def _train(self) -> None:
        cfg, plan = self.plan.config, self.plan
        num_samples = open_dataset(cfg).num_samples
        tokens = cfg.global_batch * cfg.model.seq_len
        root, info = self.storage.checkpoint_root, checkpoint_info(cfg)

        def saves_after(step: int) -> bool:
            every = cfg.checkpoint.every
            return every > 0 and (step + 1) % every == 0 and step + 1 < cfg.steps

        def evaluates(step: int) -> bool:
            return cfg.eval.every > 0 and ((step + 1) % cfg.eval.every == 0 or step + 1 == cfg.steps)

        def submit(step: int) -> list[ray.ObjectRef]:
            ids = global_batch_ids(cfg.seed, step, cfg.global_batch, num_samples)
            evaluate = evaluates(step)
            save = {"root": root, "info": info, "background": cfg.checkpoint.async_} if saves_after(step) else None
            drills = self._drills_at(step)
            return [w.run_step.remote(step, rank_share(ids, plan.coords(r).dp, plan.dp, plan.microbatches),
                                      evaluate, save, drills.get(r))
                    for r, w in enumerate(self.workers)]

        done = self.start_step
        if done >= cfg.steps or self._stop_requested:
            return
        start, refs = time.perf_counter(), submit(done)
        self._step_started = time.time()
        for step in range(self.start_step, cfg.steps):
            if self._drill_kills_coordinator(step):
                log.warning("job %s: fault drill kill_coordinator at step %d", self.job_id, step)
                os._exit(17)
            # Queue step + 1 before waiting for step: a worker runs its calls in order and starts the next
            # step the moment it finishes this one, so the round trip to the coordinator (results back,
            # next call out) is off the critical path. At most one step is queued ahead; a stop request
            # lets it finish, so the final checkpoint holds exactly the steps recorded.
            ahead = step + 1 < cfg.steps and not self._stop_requested and self._resize_to is None
            upcoming = submit(step + 1) if ahead else []
            self._upcoming = upcoming
            # A step that also saves or evaluates is not held to the hang detector's measure of plain steps.
            # Nor is the first step after a (re)start, a recovery or a resize: it includes the ranks' warm-up.
            plain = not (saves_after(step) or evaluates(step)) and step > self.start_step
            deadline = self._step_deadline() if plain else cfg.fault.step_timeout_s
            results = await self._call_all(refs, f"step {step}", deadline, hang=plain, next_calls=upcoming)
            now = time.perf_counter()
            self._record(step, results, now - start, tokens)
            start, refs, done = now, upcoming, step + 1
            self._step_started = time.time()
            if not refs:
                break
        self.start_step = done
        if self._resize_to is not None and done < cfg.steps and not self._stop_requested:
            return  # to `_resize`, then back here with the new layout
        await self._finish_training(done, saved=saves_after(done - 1))

    def _drills_at(self, step: int) -> dict[int, str]:
        """The workers' drills due at `step`, by rank; each runs once."""
        due = [d for d in self.drills if d["at_step"] <= step and d["kind"] != "kill_coordinator"]
        self.drills = [d for d in self.drills if d not in due]
        return {d["rank"]: d["kind"] for d in due}

    def _drill_kills_coordinator(self, step: int) -> bool:
        """A kill_coordinator drill is due as the coordinator waits for `step` (its restart has no drills)."""
        return any(d["kind"] == "kill_coordinator" and d["at_step"] <= step for d in self.drills)

    def _step_deadline(self) -> float:
        """How long a step may take before it counts as hung: hang_factor x the median of the recent steps
        (with a floor), once there are a few; never more than step_timeout_s."""
        fault = self.plan.config.fault
        recent = sorted(row["step_time_s"] for row in self.metrics[-HANG_WINDOW:])
        if len(recent) < HANG_MIN_STEPS:
            return fault.step_timeout_s
        return min(fault.step_timeout_s, max(fault.hang_floor_s, fault.hang_factor * recent[len(recent) // 2]))

    async def _finish_training(self, steps_done: int, saved: bool) -> None:
        """The final checkpoint, then the model consolidated from it into one safetensors file."""
        root, cfg = self.storage.checkpoint_root, self.plan.config
        await self._call_all([w.final_checkpoint.remote(root, steps_done, checkpoint_info(cfg), saved)
                              for w in self.workers], "the final checkpoint", cfg.fault.step_timeout_s)
        if self._suspend:
            return
        directory = checkpoint.step_dir(Path(root), steps_done)
        path = await asyncio.to_thread(export_model, cfg, directory, steps_done, Path(self.storage.model_path))
        self.model = {"path": str(path), "step": steps_done}
        log.info("job %s: model after step %d exported to %s", self.job_id, steps_done, path)

    def _record(self, step: int, results: list[dict], elapsed: float, tokens: int) -> None:
        events_before = len(self.events)
        last = next(r for r in results if r["loss"] is not None)
        row = {
            "step": step,
            "loss": last["loss"],
            "lr": last["lr"],
            "grad_norm": last["grad_norm"],
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed,
            # Wall time between two steps' results that no rank spent computing.
            "coordinator_overhead_s": max(0.0, elapsed - max(r["compute_s"] for r in results)),
            **pipeline_metrics(results),
        }
        moe = moe_metrics(results)
        if moe:
            row["moe"] = moe
        val = [r["val_loss"] for r in results if r.get("val_loss") is not None]
        if val:
            row["val_loss"] = val[0]
        blocked = [r["checkpoint_blocked_s"] for r in results if "checkpoint_blocked_s" in r]
        if blocked:
            row["checkpoint_blocked_s"] = max(blocked)  # the step waited for its slowest rank's save
            self.events.append({"time": time.time(), "kind": "checkpoint", "step": step + 1,
                                "blocked_s": row["checkpoint_blocked_s"]})
        if self._failed_at is not None:
            now = time.time()
            self.events.append({"time": now, "kind": "recovered", "step": step + 1,
                                "recovery_s": now - self._failed_at, "failure": len(self.causes)})
            self._failed_at = None
        self.metrics.append(row)
        append_metrics_log(Path(self.storage.checkpoint_root), row)
        if len(self.events) != events_before:
            self._write_journal()
        for key, gauge in _GAUGES.items():
            gauge.set(row[key] if key != "step" else step + 1, tags={"job_id": self.job_id})
        for key, gauge in _STAGE_GAUGES.items():
            for stage, value in enumerate(row[key]):
                gauge.set(value, tags={"job_id": self.job_id, "stage": str(stage)})
        for layer, values in moe.items():
            tags = {"job_id": self.job_id, "layer": layer}
            for key, gauge in _MOE_GAUGES.items():
                gauge.set(values[key], tags=tags)
            for expert, load in enumerate(values["load"]):
                _EXPERT_LOAD.set(load, tags={**tags, "expert": str(expert)})
        if step == 0 or (step + 1) % 10 == 0:
            log.info("job %s step %d/%d loss %.4f", self.job_id, step + 1, self.plan.config.steps, row["loss"])

    async def _call_all(self, refs: list, what: str, timeout: float, hang: bool = False,
                        next_calls: list | None = None) -> list:
        """Await one call per worker; the first failure (or the timeout) raises StepFailed. `hang`: the
        timeout is the hang detector's (see `_step_deadline`), and the message says so. `next_calls`: the
        calls queued after these; a rank that answered and then died (its peers failing on it while they
        finish) shows as their failure, and is blamed."""
        tasks = {asyncio.ensure_future(ref): rank for rank, ref in enumerate(refs)}
        done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        # After a first failure, wait a moment for a rank's death to be reported (its peers' errors often
        # come first), but no longer once a death is known: the ranks still running are then blocked on it.
        grace_end = time.monotonic() + DEATH_GRACE_S
        while pending and any(t.exception() is not None for t in done) and not any(
                isinstance(t.exception(), ray.exceptions.RayActorError) for t in done):
            more, pending = await asyncio.wait(pending, timeout=max(0.0, grace_end - time.monotonic()),
                                               return_when=asyncio.FIRST_EXCEPTION)
            done |= more
            if not more:
                break
        for task in pending:
            task.cancel()
        failures = {tasks[t]: t.exception() for t in done if t.exception() is not None}
        if failures and next_calls and not any(isinstance(e, ray.exceptions.RayActorError) for e in failures.values()):
            later = {asyncio.ensure_future(ref): rank for rank, ref in enumerate(next_calls)}
            finished, unfinished = await asyncio.wait(later, timeout=max(0.0, grace_end - time.monotonic()),
                                                      return_when=asyncio.FIRST_EXCEPTION)
            for task in unfinished:
                task.cancel()
            failures |= {later[t]: t.exception() for t in finished
                         if isinstance(t.exception(), ray.exceptions.RayActorError)}
        late = tuple(sorted(tasks[t] for t in pending))
        if failures:
            dead = tuple(sorted(r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError)))
            raised = tuple(sorted(set(failures) - set(dead)))
            raise StepFailed(self._describe_failure(failures, what), dead=dead, raised=raised, pending=late,
                             blamed=dead or raised[:1])
        if pending:
            rule = ("fault.hang_factor x the median recent step, at least fault.hang_floor_s" if hang and
                    timeout < self.plan.config.fault.step_timeout_s else "fault.step_timeout_s")
            raise StepFailed(f"{what} hung: no answer after {timeout:.3g} s ({rule}); ranks still running: "
                             f"{list(late)}", pending=late, blamed=late)
        return [task.result() for task in tasks]

    def _describe_failure(self, failures: dict[int, BaseException], what: str) -> str:
        """Blame the ranks whose process died if any did (their peers' errors are consequences), else the
        lowest rank that raised."""
        dead = sorted(r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError))
        if dead:
            lines = [f"rank {r} ({self.plan.worker_name(r)}) died in {what}: its process exited "
                     f"({_death_cause(failures[r], self._rank_info(r))})" for r in dead]
            others = sorted(set(failures) - set(dead))
            if others:
                lines.append(f"ranks {others} then failed talking to it (not a cause)")
            return "\n".join(lines)
        rank = min(failures)
        return (f"rank {rank} ({self.plan.worker_name(rank)}) failed in {what}:\n"
                f"{_remote_traceback(failures[rank])}")

    def _rank_info(self, rank: int) -> dict:
        return self.ranks[rank] if rank < len(self.ranks) else {}

    def _release(self) -> None:
        """Kill every rank (a peer blocked in a collective cannot outlive the job) and give back the placement
        groups reserved to grow. The service removes the admitted one."""
        for worker in self.workers:
            if worker is not None:
                ray.kill(worker, no_restart=True)
        self.workers = []
        for pg in self.grown:
            remove_placement_group(pg)
        self.grown, self.spare = [], []


def _placed(slot: tuple[PlacementGroup, int]) -> bool:
    """Whether Ray has the bundle on a live node now (not while it re-places the bundles of a lost node)."""
    try:
        return bool(ray.util.placement_group_table(slot[0])["bundles_to_node_id"].get(slot[1]))
    except Exception:  # noqa: BLE001 - a group removed meanwhile
        return False


def _was_restarted() -> bool:
    with warnings.catch_warnings():  # Ray marks the property deprecated but offers no replacement for it
        warnings.simplefilter("ignore")
        return ray.get_runtime_context().was_current_actor_reconstructed


def read_journal(root: Path) -> dict:
    try:
        return json.loads((root / JOURNAL).read_text())
    except (OSError, ValueError):
        return {}


def write_journal(root: Path, state: dict) -> None:
    """Replace the journal atomically (a crash mid-write leaves the previous one)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{JOURNAL}.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(root / JOURNAL)


def merge_events(*lists: list[dict]) -> list[dict]:
    """The events of every list, each once, oldest first."""
    unique = {(e["time"], e["kind"]): e for events in lists for e in events}
    return [unique[key] for key in sorted(unique)]


def append_metrics_log(root: Path, row: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with (root / METRICS_LOG).open("a") as f:
        f.write(json.dumps(row) + "\n")


def read_metrics_log(root: Path) -> list[dict]:
    """The last row written for each step, in step order (a step run again after a recovery wrote it again;
    a line cut short by a crash is skipped)."""
    rows: dict[int, dict] = {}
    try:
        lines = (root / METRICS_LOG).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        rows[row["step"]] = row
    return [rows[step] for step in sorted(rows)]


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def pipeline_metrics(results: list[dict]) -> dict:
    """Per-stage timings of the first pipeline (data-parallel and tensor-parallel rank 0), and its measured
    bubble fraction.

    bubble = 1 - (time the stages spent computing) / (pp x the longest stage's schedule wall time).
    """
    stages = sorted((r for r in results if r["dp_rank"] == 0 and r["tp_rank"] == 0), key=lambda r: r["pp_rank"])
    busy = sum(r["forward_s"] + r["backward_s"] for r in stages)
    span = max(r["schedule_s"] for r in stages)
    return {
        "bubble_fraction": max(0.0, 1.0 - busy / (len(stages) * span)) if span > 0 else 0.0,
        "stage_forward_s": [r["forward_s"] for r in stages],
        "stage_backward_s": [r["backward_s"] for r in stages],
        "stage_peak_activations": [r["peak_activations"] for r in stages],
        "stage_peak_activation_mb": [r["peak_activation_bytes"] / 2**20 for r in stages],
    }


def moe_metrics(results: list[dict]) -> dict[str, dict]:
    """Each MoE layer's statistics, keyed by its block index; every rank of a stage holds the stage's sums, so
    the first pipeline's ranks have them all."""
    stages = (r for r in results if r["dp_rank"] == 0 and r["tp_rank"] == 0)
    layers = {layer: values for r in stages for layer, values in r["moe"].items()}
    return dict(sorted(layers.items(), key=lambda item: int(item[0])))


def _death_cause(error: BaseException, info: dict) -> str:
    where = f"pid {info['pid']} on node {info['node']}; " if info else ""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{where}Ray: {first_line}"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _remote_traceback(error: BaseException) -> str:
    """The worker's own traceback when Ray carried one, without terminal colour codes."""
    if not isinstance(error, ray.exceptions.RayTaskError):  # e.g. the actor died: no Python traceback
        return str(error)
    return "Traceback (most recent call last), from " + _ANSI.sub("", str(error)).strip()
