"""The coordinator's driver loop (Ray Train v2's controller): each pass runs the action the current state
asks for, turns what happened into an outcome, and sets `state.step(state, outcome, inputs)` as the next
state. `_set_state` is the only place the state changes; it logs the change and tells the listeners.

The actions: PENDING verifies the point to start from (in a thread: hashing a checkpoint of many GB never
blocks the actor's event loop, so polls and stops are answered meanwhile); STARTING creates the ranks and
loads it; RUNNING runs steps (`actions.training`); RECOVERING and RESIZING run the one recovery-and-resize
sequence (`actions.recovery`); FINISHING and STOPPING write the final checkpoint (and the model). Each action is a
part of its own (`actors.actions`), built here with the few pieces of the job it works on; none sees the
controller. What is left here: the loop, a failed call turned into an outcome, the point to start or go on from,
and the requests from outside (stop, scale).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import ray
from trainyard.actors.actions.recording import StepRecorder
from trainyard.actors.actions.recovery import Recovery
from trainyard.actors.actions.rejoin import Rejoin
from trainyard.actors.actions.replica_drop import ReplicaDrop
from trainyard.actors.actions.requests import Drills, Requests
from trainyard.actors.actions.training import StepLoop
from trainyard.actors.calls import Failure, StepFailed, Unrecoverable, first_line, own_error
from trainyard.actors.failure_handling.policy import FailureAction
from trainyard.actors.failure_handling.registry import DEFAULT as DEFAULT_POLICY
from trainyard.actors.failure_handling.registry import failure_policy
from trainyard.actors.journal import METRICS_LOG, Journal, mtime, read_metrics_log, steps_logged
from trainyard.actors.progress import Progress
from trainyard.actors.scaling_policy.resize_desk import ResizeDesk
from trainyard.actors.scaling_policy.scaling import ResizeDecision, scaling_policy
from trainyard.actors.state import (
    Admitted,
    CallFailed,
    Cancelled,
    Crashed,
    Done,
    Failed,
    Finishing,
    Inputs,
    JobStatus,
    Outcome,
    Pending,
    Point,
    Ready,
    Recovering,
    Resizing,
    Running,
    Starting,
    State,
    Stopping,
    failure_decision,
    is_terminal,
    step,
)
from trainyard.actors.storage import JobStorage
from trainyard.actors.telemetry import Rows
from trainyard.actors.tracking import Trackers
from trainyard.actors.worker_group.oom_killer import OomCounts, oom_killed, read_on_node, unexpected_exit
from trainyard.actors.worker_group.worker_group import WorkerGroup, alive_nodes, slot_keys
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import Plan, resize_plan

log = logging.getLogger("trainyard.coordinator")


class Controller:
    def __init__(self, job_id: str, plan: Plan, pg, storage: JobStorage, restarted: bool,
                 failure_policy_name: str = DEFAULT_POLICY):
        """`failure_policy_name`: the failure policy's name in `failure_handling.registry`."""
        self.job_id, self.storage, self.restarted = job_id, storage, restarted
        self.root = Path(storage.checkpoint_root)
        self.incarnation = uuid.uuid4().hex[:8]
        """Changes when Ray restarts the coordinator: the service then reads the events anew."""
        self.group = WorkerGroup(job_id, plan, pg)
        self.progress = Progress(start_step=storage.resume[1] if storage.resume else 0)
        self.journal = Journal(self.root, list(storage.events), restarted)
        rows = read_metrics_log(self.root)
        # Steps the metrics log holds were logged to the trackers by the coordinator that ran them.
        self.trackers = Trackers(job_id, plan.config, self.root, last_logged=max((r["step"] for r in rows), default=-1))
        kept = rows if restarted else [r for r in rows if r["step"] < self.progress.start_step]
        self.rows = Rows(self.root, kept, self.trackers)
        self.failure_policy = failure_policy(plan, failure_policy_name)
        self.scaling = scaling_policy(plan)
        self.desk = ResizeDesk()
        self.drills = Drills()
        self.requests = Requests()
        self.state: State = Pending()
        self.listeners: list[Callable[[State, State], None]] = [self._close_trackers]
        self.model: dict | None = None
        """The exported model, {path, step}, once the job's end wrote it (`Done.model`)."""
        # The states' actions, each handed the pieces of the job it works on.
        group, progress, journal = self.group, self.progress, self.journal
        self.recorder = StepRecorder(job_id, lambda: group.plan, progress, journal, self.rows)
        self.loop = StepLoop(job_id, storage, group, progress, self.rows, self.recorder, self.drills, self.requests,
                             self.desk)
        rejoin = Rejoin(job_id, group, progress, self.rows)
        self.recovery = Recovery(job_id, storage, group, progress, self.rows, journal, self.drills, rejoin,
                                 ReplicaDrop(job_id, group, progress, journal, self.drills, self.recorder, rejoin))

    @property
    def plan(self) -> Plan:
        return self.group.plan

    @property
    def error(self) -> str | None:
        return self.state.error if isinstance(self.state, Failed) else None

    def report(self, since: int, events_from: int | None = None) -> dict:
        """Status, error, the metrics rows of steps >= `since` and the events from index `events_from` (all when
        None): the work does not grow with the job's length."""
        events = self.journal.events
        return {
            "status": self.state.status.value, "error": self.error, "model": self.model,
            "step": self.rows.next_step(self.progress.start_step),
            "events": events if events_from is None else events[events_from:],
            "events_from": events_from, "incarnation": self.incarnation,
            "metrics": self.rows.since(since), "actors": self.group.actor_names(), "ranks": self.group.ranks,
        }

    def _close_trackers(self, old: State, new: State) -> None:
        if is_terminal(new):
            self.trackers.close(new.status.value)

    def _set_state(self, new: State) -> None:
        old, self.state = self.state, new
        log.info("job %s: %s -> %s (%s)", self.job_id, old.status, new.status, type(new).__name__)
        for listener in self.listeners:
            listener(old, new)

    def _inputs(self) -> Inputs:
        restarted = None
        if self.restarted and isinstance(self.state, Pending):
            restarted = self._own_death()
        return Inputs(steps=self.plan.config.steps, causes=tuple(self.journal.causes), stop=self.requests.stop,
                      suspend=self.requests.suspend, resize=self.desk.ready, restarted=restarted)

    # --- the loop -------------------------------------------------------------------------------------

    async def run(self) -> None:
        grower = None
        try:
            while True:
                try:
                    outcome = await self._act(self.state)
                    if isinstance(outcome, Done) and outcome.model is not None:
                        self.model = outcome.model
                except StepFailed as failure:
                    outcome = await self._failed_safely(failure)
                except Unrecoverable as e:
                    outcome = Crashed(str(e))
                except asyncio.CancelledError:
                    outcome = Cancelled()
                except Exception as e:  # noqa: BLE001 - any other error ends the job, said in a sentence
                    log.exception("job %s: the coordinator failed while %s", self.job_id, self.state.status)
                    outcome = Crashed(own_error(e, f"while the job was {self.state.status}"))
                try:
                    new = step(self.state, outcome, self._inputs(), self.failure_policy)
                except Exception as e:  # noqa: BLE001 - a missing transition is a bug: fail the job, never hang it
                    log.exception("job %s: no transition from %s on %s", self.job_id, self.state, type(outcome))
                    new = Failed(own_error(e, f"deciding what follows {type(outcome).__name__} in {self.state.status}"))
                if isinstance(new, Resizing):
                    self.desk.take()
                if is_terminal(new):
                    break
                self._set_state(new)
                if grower is None and self.plan.dp_range is not None and isinstance(new, Running):
                    grower = asyncio.get_running_loop().create_task(self._grow_when_possible())
        finally:
            if grower is not None:
                grower.cancel()
            self.group.release()
        self._set_state(new)  # terminal once the workers and grown placement groups are released

    async def _act(self, state: State) -> Outcome:
        match state:
            case Pending():
                return Admitted(await asyncio.to_thread(self._start_point))
            case Starting(restore=restore):
                self.rows.trim(self.progress.start_step)  # a damaged resume point may have moved it back
                await self.group.start()
                await self.group.load(restore)
                return Ready()
            case Running():
                return await self.loop.run()
            case Recovering():
                return await self.recovery.recover(state)
            case Resizing():
                return await self.recovery.resize(state)
            case Finishing(steps_done=done, saved=saved) | Stopping(steps_done=done, saved=saved):
                return await self.loop.finish(done, saved)
        raise AssertionError(f"no action for {state}")

    async def _failed_safely(self, error: StepFailed) -> Outcome:
        """`_failed`, whose own error (raised in an `except` clause, the loop's other clauses would not catch it,
        and the job would hang in its state) fails the job in a sentence naming both."""
        try:
            return await self._failed(error)
        except Exception as e:  # noqa: BLE001
            log.exception("job %s: the coordinator failed handling a failure", self.job_id)
            return Crashed(own_error(e, f"handling a failure ({first_line(error)})"))

    async def _failed(self, error: StepFailed) -> Outcome:
        """A failed call as an outcome: the failure, whether a node was lost, and the point to go on from (only
        looked for when the job will recover: it hashes the checkpoint, in a thread)."""
        failure = Failure.of(error, self.rows.next_step(self.progress.start_step), self.progress.step_started)
        if failure.dead and not failure.out_of_memory:
            failure = await self._oom_killed(failure)
        if failure.out_of_memory:
            failure = replace(failure, cause=f"{failure.cause}\n{self._memory_note(failure.out_of_memory)}")
        if isinstance(self.state, Starting) and not failure.dead:
            return CallFailed(failure, None)  # a job that cannot start is not recovered (`state.step`)
        elastic = self.plan.dp_range is not None
        node_lost = elastic and not self.requests.stop and await self._node_lost(failure)
        decision = failure_decision(CallFailed(failure, None, node_lost), self._inputs(), self.failure_policy)
        log.info("job %s: failure policy: %s (%s)", self.job_id, decision.action, decision.reason)
        if decision.action is FailureAction.RAISE:
            return CallFailed(failure, None, node_lost)
        # A lost node does not change a fixed-size job's decision, but its recovery must see the node gone to wait
        # for its resources (`actions.recovery`) rather than place a rank on it: Ray's word, got while the checkpoint is
        # hashed.
        news = self._node_lost(failure) if not elastic else asyncio.sleep(0, False)
        restore, lost = await asyncio.gather(asyncio.to_thread(self.restore_point), news)
        return CallFailed(failure, restore, node_lost or lost)

    async def _oom_killed(self, failure: Failure) -> Failure:
        """`failure` with the ranks the kernel's OOM killer killed among its dead (`oom_killer`: the OOM-kill counts
        on each one's node, read at its setup and now) as out of memory, each named with its node and the count."""
        deaths, alive, counts = dict(failure.deaths), alive_nodes(), self.group.oom_counts
        ranks = [r for r in failure.dead if unexpected_exit(deaths.get(r, ""))
                 and self.group.rank_info(r).get("node_id") in alive and r < len(counts) and counts[r]]
        if not ranks:
            return failure
        befores = {r: OomCounts(**(counts[r] or {})) for r in ranks}
        afters = await asyncio.gather(*(read_on_node(self.group.rank_info(r)["node_id"], befores[r].cgroup_path)
                                        for r in ranks))
        found = {}
        for r, after in zip(ranks, afters, strict=True):
            why = oom_killed(deaths[r], befores[r], after)
            if why:
                found[r] = f"rank {r} ({self.plan.worker_name(r)}) on node {self.group.rank_info(r).get('node')}: {why}"
        log.info("job %s: ranks %s died; killed by the kernel's OOM killer: %s", self.job_id, ranks, list(found))
        if not found:
            return failure
        return replace(failure, out_of_memory=tuple(found), cause="\n".join([failure.cause, *found.values()]))

    def _memory_note(self, ranks: tuple[int, ...]) -> str:
        """What a user needs beside an out-of-memory failure: the plan's prediction for those ranks, the largest
        resident peak the ranks reported, and what to change (the same layout would run out again)."""
        from trainyard.parallel.plan.memory.estimate import estimate
        from trainyard.parallel.plan.units import format_size

        predicted = estimate(self.plan.layout, self.plan.config)
        plans = ", ".join(f"rank {r}: {format_size(predicted[r].total)}" for r in ranks)
        largest = self.rows.largest_peak_rss()
        peaks_by_rank = self.recorder.rank_peaks
        own = "".join(f"; rank {r}'s last measured resident peak: {format_size(peaks_by_rank[r])}"
                      for r in ranks if r in peaks_by_rank)
        measured = own + (f"; the largest rank's resident peak measured before it: {format_size(largest)}"
                          if largest else "")
        return (f"Out of memory: the plan predicted {plans} (what `trainyard plan` shows){measured}. Not retried: the "
                "same layout would run out again. Use smaller micro-batches (more parallel.microbatches), "
                "activation_checkpointing, a higher parallel.zero or optimizer.offload, or spread the model over "
                "more ranks (pp, tp).")

    def restore_point(self) -> Point | None:
        """Where a recovery goes on from: the latest valid checkpoint with every step before it in the metrics log,
        else the resume point, else the start."""
        found = checkpoint.latest_valid(self.root, at_most=steps_logged(self.root))
        if found is None:
            return self.storage.resume
        if found.skipped:
            self._passed_over(found.skipped, found.step)
        return str(found.directory), found.step

    def _passed_over(self, damaged: tuple[str, ...], step: int) -> None:
        """An event for the damaged checkpoints a start or a recovery passed over, and the step it goes on from:
        the steps lost to them are said, not silent."""
        self.journal.add_event({"time": time.time(), "kind": "checkpoint_damaged", "damaged": list(damaged),
                                "restore_step": step})
        log.warning("job %s: passed over damaged checkpoints (%s); going on from step %d", self.job_id,
                    "; ".join(damaged), step)

    def _start_point(self) -> Point | None:
        """The point to start from, its files hashed (the service checked only their sizes): a restarted
        coordinator's latest valid checkpoint; else the resume point, or if that is damaged the newest intact
        checkpoint before it of the job `resume_from` names (when no step was named), else of this job."""
        if self.restarted:
            return self.restore_point()
        resume = self.storage.resume
        if resume is None:
            return None
        began = time.time()
        problem = checkpoint.verify(Path(resume[0]))
        if problem is None:
            self.journal.add_event({"time": time.time(), "kind": "verified", "step": resume[1],
                                    "verify_s": time.time() - began})
            return resume
        logged = steps_logged(self.root)
        root, before = (Path(resume[0]).parent, resume[1] - 1) if self.storage.resume_falls_back else \
            (self.root, resume[1] - 1 if logged is None else min(resume[1] - 1, logged))
        found = checkpoint.latest_valid(root, at_most=before)
        if found is None:
            raise Unrecoverable(f"the checkpoint to start from ({resume[0]}) is damaged: {problem}")
        self._passed_over((f"step {resume[1]}: {problem}", *found.skipped), found.step)
        self.progress.restarted_at(found.step)
        return str(found.directory), found.step

    def _own_death(self) -> Failure:
        last_step = self.rows.next_step(self.progress.start_step)
        last_alive = mtime(self.root / METRICS_LOG) or time.time()
        cause = (f"the coordinator died (its process exited after step {last_step}; Ray restarted it, "
                 f"restart {len(self.journal.causes) + 1} of fault.max_failures={self.plan.config.fault.max_failures})")
        return Failure(cause=cause, failed_at=last_alive, waited_s=time.time() - last_alive, step=last_step,
                       coordinator=True)

    async def _node_lost(self, failure: Failure) -> bool:
        """Whether a rank that died was on a node Ray has lost (it may take Ray a moment to say so)."""
        nodes = {self.group.rank_info(r).get("node_id") for r in failure.dead} - {None}
        if not nodes:  # no rank died (a hang, an error): no node to wait for news of
            return False
        for _ in range(10):
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if nodes - alive:
                return True
            await asyncio.sleep(0.3)
        return False

    # --- requests from outside ------------------------------------------------------------------------

    def request_stop(self, suspend: bool) -> None:
        self.requests.stop, self.requests.suspend = True, suspend

    async def request_resize(self, dp: int, reason: str) -> dict:
        """Resize to `dp` replicas at the next step boundary, the added ranks' resources reserved first; the
        new layout, or why not. Both `scale` and the elastic grower come here, and the desk decides."""
        if self.state.status is not JobStatus.RUNNING or self.desk.claimed_by or self.desk.ready:
            state = "resizing already" if self.desk.claimed_by or self.desk.ready else str(self.state.status)
            return {"refused": f"job {self.job_id} is {state}; only a RUNNING job can be resized"}
        new = resize_plan(self.plan, dp)
        layout = {"dp": new.dp, "microbatches": new.microbatches, "world_size": new.world_size}
        if dp == self.plan.dp:
            return layout
        added = sum(1 for key in slot_keys(new) if key not in self.group.slots)
        problem = await self.desk.request(
            new, reason, time.time(), running=lambda: self.state.status is JobStatus.RUNNING and not self.requests.stop,
            current=lambda: self.plan, reserve=lambda: self.group.reserve(added))
        return {"refused": problem} if problem else layout

    async def _grow_when_possible(self) -> None:
        """Elastic jobs below their max: every fault.grow_interval_s, ask the scaling policy whether the free
        resources allow more replicas, and ask the desk like any request."""
        while True:
            await asyncio.sleep(self.plan.config.fault.grow_interval_s)
            if not isinstance(self.state, Running) or self.desk.claimed_by or self.desk.ready:
                continue
            free = ray.available_resources()
            bundle = self.plan.gang.bundle
            fits = min(int(free.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0)
            decision = self.scaling.decide(self.plan, fits + self.group.placed_spare())
            if isinstance(decision, ResizeDecision):
                answer = await self.request_resize(decision.dp, decision.reason)
                if "refused" in answer:
                    log.info("job %s: no growth to dp=%d now: %s", self.job_id, decision.dp, answer["refused"])
