"""Replicas that fail alone (local_sgd, diloco; issue 32): after a rank died, its replica is dropped from the
round and the others go on stepping; it rejoins at the next sync from their state (`parallel.sync` says how
the round and the rejoin run on the ranks; `failure_handling.replicas.replicas_to_drop` when a failure allows it).

The coordinator's part, `ReplicaDrop`:
  1. the other replicas finish the failed step and the one queued after it (between syncs they wait on no
     other replica), and give the last one's figures (`Worker.flush`); the rows of the steps up to there are
     recorded, from the figures that came back (`replica_steps` shows the dropped replica standing still from
     the first step whose figures it took with it: they come one step late)
  2. the dropped replicas' ranks are killed, the others hold their own state and leave the process groups
  3. new ranks for the dropped replicas; every rank joins the new process groups; the others take their own
     state back (the new ranks take none yet); the job goes on at the step after those two
  4. until the rejoin step (`sync.rejoin_step`, the next sync) `actions.training` drives the others' steps while
     the dropped replicas sit out (`sync.round_of`); `recording.StepRecorder` writes `replica_rejoined` after
     it.
Events: `failure` (recovered_from `replicas_left`, no step lost) and `replica_dropped`. The failure counts
against `fault.max_failures` like any other.
"""

from __future__ import annotations

import logging
import time

from trainyard.actors.actions.recording import StepRecorder
from trainyard.actors.actions.rejoin import Rejoin
from trainyard.actors.actions.requests import Drills
from trainyard.actors.calls import StepFailed
from trainyard.actors.failure_handling.replicas import replicas_to_drop
from trainyard.actors.journal import Journal
from trainyard.actors.progress import Progress
from trainyard.actors.state import Recovering
from trainyard.actors.telemetry import figures_by_step, make_row
from trainyard.actors.worker_group.worker_group import WorkerGroup
from trainyard.parallel.plan.cadence import is_done
from trainyard.parallel.plan.sync.replica_sync import rejoin_step

log = logging.getLogger("trainyard.coordinator")


class ReplicaDrop:
    def __init__(self, job_id: str, group: WorkerGroup, progress: Progress, journal: Journal, drills: Drills,
                 recorder: StepRecorder, rejoin: Rejoin):
        self.job_id, self.group, self.progress, self.journal = job_id, group, progress, journal
        self.drills, self.recorder, self.rejoin = drills, recorder, rejoin

    async def __call__(self, state: Recovering) -> bool:
        """Drop the failed replicas and go on with the others (True), or leave the failure to the recovery that
        restores the job (False: nothing was torn down)."""
        group, progress, journal = self.group, self.progress, self.journal
        failure, plan, cfg = state.failure, group.plan, group.plan.config
        (step, refs), dropped = progress.inflight, progress.dropped
        broken = replicas_to_drop(plan, set(failure.dead), set(failure.raised), dropped) if state.counted else None
        # The failed call is step `step`'s; the first step without a row is it, or the one before (figures come a
        # step late).
        if broken is None or failure.step not in (step - 1, step) or len(refs) != plan.world_size:
            return False
        others = [r for r in range(plan.world_size) if plan.coords(r).dp not in broken]
        upcoming = progress.upcoming
        ahead = upcoming if len(upcoming) == plan.world_size else []
        workers = group.workers
        try:
            current = await group.call([refs[r] for r in others], f"step {step} on the replicas left")
            later = await group.call([ahead[r] for r in others], f"step {step + 1} on the replicas left") \
                if ahead else []
            flushed = await group.call([workers[r].flush.remote() for r in others],
                                       "reading the last step's figures on the replicas left")
        except StepFailed:
            return False
        resumed = step + (2 if later else 1)
        if is_done(resumed, cfg.steps):
            return False
        # The rows of the steps up to there, from the figures the failed call's answers and these calls returned; a
        # dropped replica's figures lost with its rank, its replica_steps show it standing still from there.
        tokens = cfg.global_batch * cfg.model.seq_len
        by_step = figures_by_step(plan, (*failure.answered, *current, *later, *flushed), failure.step)
        for s in range(failure.step, resumed):
            answers = list(by_step.get(s, ()))
            elapsed = progress.timed.get(s) or (failure.waited_s if s <= step else time.time() - failure.failed_at)
            self.recorder.record(make_row(s, answers, elapsed, tokens), answers)

        for rank in range(plan.world_size):
            if rank not in others:
                group.kill(rank)
        held = await group.call([group.workers[r].keep_state.remote(after_failure=True) for r in others],
                                "keeping the state of the replicas left")
        if any(steps != resumed for steps, _ in held):
            raise StepFailed(f"the replicas left hold {sorted({s for s, _ in held}, key=str)} steps, not {resumed}",
                             dead=failure.dead)

        journal.add_cause(failure.cause)
        rejoins = rejoin_step(resumed, plan.parallel.sync, cfg.steps)
        progress.resumed_at(resumed, failure.failed_at, dropped={d: rejoins for d in sorted(broken)})
        dead = list(failure.blamed)
        journal.add_event({
            "time": failure.failed_at, "kind": "failure", "cause": failure.cause, "ranks": dead,
            "waited_s": failure.waited_s, "nodes": sorted({group.rank_info(r).get("node", "") for r in dead}),
            "step": step, "steps_lost": 0, "restore_step": resumed,
            "recovered_from": "replicas_left", "failure": len(journal.causes)})
        journal.add_event({"time": time.time(), "kind": "replica_dropped", "step": step, "replicas": sorted(broken),
                           "ranks": dead, "rejoins_after_step": rejoins})
        log.warning("job %s: failure %d (%s); replicas %s dropped, the others go on at step %d, rejoin after step %d",
                    self.job_id, len(journal.causes), failure.cause.splitlines()[0], sorted(broken), resumed,
                    rejoins)
        await self.rejoin(None, in_memory=True, kill_in_recovery=self.drills.in_recovery(step))
        return True
