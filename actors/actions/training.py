"""The RUNNING state's action: the step loop, until a step boundary where it must stop (all steps done, a
stop or a resize asked for), and the final checkpoint with the exported model (FINISHING, STOPPING): `StepLoop`.

One Ray call per worker per step, queued one step ahead: a worker runs its calls in order and starts the
next step the moment it finishes this one, so the round trip to the coordinator is off the critical path. A
parameter server's SSP and ASP replicas get as many steps queued as one may run ahead of the slowest
(`parameter_server.steps_ahead`): the coordinator does not hold them in lockstep, the shards' clock does what the
consistency says. A
step's figures come back one step late (`RankDriver.queue_step`): the call for step N returns N-1's (and N's too
when N evaluates or saves), so a step's row is recorded as its figures arrive, timed by its own call (the wall
time between the previous call's answers and its own, as the rows always were); when the loop stops (the last
step, a stop, a resize) one more call (`flush`) gives the last step's, before any checkpoint of the state.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import ray
from trainyard.actors.actions.recording import StepRecorder
from trainyard.actors.actions.requests import Drills, Requests
from trainyard.actors.failure_handling.hang import HANG_WINDOW, HangPolicy
from trainyard.actors.progress import Progress
from trainyard.actors.scaling_policy.resize_desk import ResizeDesk
from trainyard.actors.state import AtBoundary, Cancelled, Done, Outcome
from trainyard.actors.storage import JobStorage, checkpoint_info
from trainyard.actors.telemetry import Rows
from trainyard.actors.worker_group.worker_group import WorkerGroup
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan.cadence import evaluates_after, is_done, saves_after
from trainyard.parallel.plan.sync.parameter_server import server_event, steps_ahead
from trainyard.parallel.plan.sync.replica_sync import round_of
from trainyard.parallel.runtime.step.step_stats import Save

log = logging.getLogger("trainyard.coordinator")


class StepLoop:
    def __init__(self, job_id: str, storage: JobStorage, group: WorkerGroup, progress: Progress, rows: Rows,
                 recorder: StepRecorder, drills: Drills, requests: Requests, desk: ResizeDesk):
        """`rows`: read for the recent step times (the hang policy's measure); `desk`: whether a resize waits at
        the next boundary."""
        self.job_id, self.storage, self.group, self.progress, self.rows = job_id, storage, group, progress, rows
        self.recorder, self.drills, self.requests, self.desk = recorder, drills, requests, desk
        self.hang = HangPolicy(group.plan.config.fault)

    async def run(self) -> Outcome:
        """Steps from `progress.start_step` until a boundary where the loop must stop."""
        plan, cfg, group, progress = self.group.plan, self.group.plan.config, self.group, self.progress
        root, info = self.storage.checkpoint_root, checkpoint_info(cfg)

        def submit(step: int) -> list[ray.ObjectRef]:
            save = Save(Path(root), info, cfg.checkpoint.async_) if saves_after(cfg, step) else None
            drills = self.drills.due_on_ranks(step)
            dropped = progress.dropped
            taking_part = round_of(step, plan.dp, dropped)  # None: every replica steps
            round_ = None if taking_part is None else {"live": taking_part[0], "rejoining": taking_part[1]}
            # A validation pass needs every replica: while one sits out, it waits for the rejoin.
            evaluate = evaluates_after(cfg, step) and (taking_part is None or set(taking_part[1]) == set(dropped))
            # Each rank draws its own share of the step's global batch (a function of seed and step): the
            # coordinator needs neither the data nor torch, so it starts in a fraction of a second.
            return [w.run_step.remote(step, None, evaluate, save, drills.get(r), round_)
                    for r, w in enumerate(group.workers)]

        done = progress.start_step
        if self.requests.stop:
            # Stopped before a step ran here. The ranks hold the state after `done` steps: a checkpoint's, or, after
            # a recovery from a live replica, one that dropped a replica or an in-memory resize, steps no checkpoint
            # holds. The final checkpoint (unless this job has it already) and the model keep them.
            return AtBoundary(done, saved=done in checkpoint.committed_steps(Path(root))) if done > 0 else Cancelled()
        if is_done(done, cfg.steps):  # recovered after the last step (a failure in the final checkpoint or export)
            return AtBoundary(done, saved=done in checkpoint.committed_steps(Path(root)))
        # One step queued ahead, or under a parameter server's SSP or ASP as many as a replica may run ahead of
        # the slowest: each rank goes through its own queue, the loop reading each step's answers as they come.
        window = steps_ahead(plan.parallel.sync.consistency, plan.parallel.sync.staleness) if plan.sync.server else 1
        start, queued = time.perf_counter(), {done: submit(done)}
        progress.step_began()
        for step in range(progress.start_step, cfg.steps):
            if self.drills.kills_coordinator(step):
                log.warning("job %s: fault drill kill_coordinator at step %d", self.job_id, step)
                os._exit(17)
            # A stop or a resize lets the steps queued finish, so the final checkpoint holds exactly the steps
            # recorded.
            while (following := max(queued) + 1) < cfg.steps and following <= step + window and \
                    not self.requests.stop and self.desk.ready is None:
                queued[following] = submit(following)
            refs = queued.pop(step)
            upcoming = [ref for s in sorted(queued) for ref in queued[s]]
            # A step that also saves or evaluates is not held to the hang policy's measure of plain steps. Nor is
            # the first step after a (re)start, a recovery or a resize: it includes the ranks' warm-up.
            plain = not (saves_after(cfg, step) or evaluates_after(cfg, step)) and step > progress.start_step
            deadline = self.hang.deadline(self.rows.recent_step_times(HANG_WINDOW)) if plain else \
                cfg.fault.step_timeout_s
            progress.waiting_for(step, refs, upcoming)
            answers = await group.call(refs, f"step {step}", deadline, hang=plain, next_calls=upcoming)
            now = time.perf_counter()
            progress.step_timed(step, now - start)
            self.recorder.record_answers(answers)
            start, done = now, step + 1
            progress.step_began()
            if not queued:
                break
        # The last step's figures, read (and checked for divergence) before the final checkpoint, a stop or a resize.
        progress.waiting_for(done, [], [])
        self.recorder.record_answers(await group.call([w.flush.remote() for w in group.workers],
                                                      f"reading step {done - 1}'s figures"))
        progress.stopped_at(done)
        return AtBoundary(done, saved=saves_after(cfg, done - 1) and progress.checkpoint_failures == 0)

    async def finish(self, steps_done: int, saved: bool) -> Outcome:
        """The final checkpoint, then (unless the service suspends the job) the model consolidated from it into one
        safetensors file."""
        group, plan = self.group, self.group.plan
        root, cfg = self.storage.checkpoint_root, plan.config
        # Stopped while a replica sat out (local_sgd, diloco): the live replicas sync, and the others take a live
        # one's state, as at a rejoin, so the checkpoint is one model.
        live = self.progress.take_dropped(plan.dp)
        await group.call([w.final_checkpoint.remote(root, steps_done, checkpoint_info(cfg), saved, live)
                          for w in group.workers], "the final checkpoint")
        if group.shards:  # parameter_server: what its shards applied, in one event
            self.recorder.journal.add_event(server_event(await group.shard_updates(), plan.dp))
        if self.requests.suspend:
            return Done()
        directory = checkpoint.step_dir(Path(root), steps_done)
        for rank in self.drills.in_export():  # the drill: a rank's process dies as the model is exported
            log.warning("job %s: fault drill kill_worker_in_export on rank %d", self.job_id, rank)
            ray.kill(group.workers[rank], no_restart=True)
        # Rank 0 exports: it has torch loaded, and the coordinator need not import it as the job ends. Through the
        # group's call, as every call to the ranks: a death there (its node lost as the job ends) is a failure that
        # is recovered from (the final checkpoint, then the export again), not the coordinator's own error (which
        # failed the job, with a traceback, once the soak removed a node during an export).
        [exported] = await group.call([group.workers[0].export_model.remote(str(directory), steps_done,
                                                                            self.storage.model_path)],
                                      "the model's export")
        path = Path(exported)
        log.info("job %s: model after step %d exported to %s", self.job_id, steps_done, path)
        return Done(model={"path": str(path), "step": steps_done})
