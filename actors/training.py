"""The RUNNING state's action: the step loop, until a step boundary where it must stop (all steps done, a
stop or a resize asked for), and the final checkpoint with the exported model (FINISHING, STOPPING).

One Ray call per worker per step, queued one step ahead: a worker runs its calls in order and starts the
next step the moment it finishes this one, so the round trip to the coordinator is off the critical path. A
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
from typing import TYPE_CHECKING

import ray
from trainyard.actors.calls import Unrecoverable
from trainyard.actors.policies import HANG_WINDOW
from trainyard.actors.state import AtBoundary, Cancelled, Done, Outcome
from trainyard.actors.storage import checkpoint_info
from trainyard.actors.telemetry import checkpoint_event, compile_event, make_row, set_gauges
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan.cadence import evaluates_after, is_done, saves_after

if TYPE_CHECKING:
    from trainyard.actors.controller import Controller

log = logging.getLogger("trainyard.coordinator")


async def run_steps(ctl: Controller) -> Outcome:
    from trainyard.parallel.plan.replica_sync import round_of

    plan, cfg = ctl.plan, ctl.plan.config
    root, info = ctl.storage.checkpoint_root, checkpoint_info(cfg)

    def submit(step: int) -> list[ray.ObjectRef]:
        save = {"root": root, "info": info, "background": cfg.checkpoint.async_} if saves_after(cfg, step) else None
        drills = ctl.drills.due_on_ranks(step)
        dropped = ctl.progress.dropped
        taking_part = round_of(step, plan.dp, dropped)  # None: every replica steps
        round_ = None if taking_part is None else {"live": taking_part[0], "rejoining": taking_part[1]}
        # A validation pass needs every replica: while one sits out, it waits for the rejoin.
        evaluate = evaluates_after(cfg, step) and (taking_part is None or set(taking_part[1]) == set(dropped))
        # Each rank draws its own share of the step's global batch (a function of seed and step): the coordinator
        # needs neither the data nor torch, so it starts in a fraction of a second.
        return [w.run_step.remote(step, None, evaluate, save, drills.get(r), round_)
                for r, w in enumerate(ctl.group.workers)]

    progress = ctl.progress
    done = progress.start_step
    if ctl.stop:
        # Stopped before a step ran here. The ranks hold the state after `done` steps: a checkpoint's, or, after a
        # recovery from a live replica, one that dropped a replica or an in-memory resize, steps no checkpoint
        # holds. The final checkpoint (unless this job has it already) and the model keep them.
        return AtBoundary(done, saved=done in checkpoint.committed_steps(Path(root))) if done > 0 else Cancelled()
    if is_done(done, cfg.steps):  # recovered after the last step (a failure in the final checkpoint or export)
        return AtBoundary(done, saved=done in checkpoint.committed_steps(Path(root)))
    start, refs = time.perf_counter(), submit(done)
    progress.step_began()
    for step in range(progress.start_step, cfg.steps):
        if ctl.drills.kills_coordinator(step):
            log.warning("job %s: fault drill kill_coordinator at step %d", ctl.job_id, step)
            os._exit(17)
        # At most one step is queued ahead; a stop or a resize lets it finish, so the final checkpoint holds
        # exactly the steps recorded.
        ahead = step + 1 < cfg.steps and not ctl.stop and ctl.desk.ready is None
        upcoming = submit(step + 1) if ahead else []
        # A step that also saves or evaluates is not held to the hang policy's measure of plain steps. Nor is
        # the first step after a (re)start, a recovery or a resize: it includes the ranks' warm-up.
        plain = not (saves_after(cfg, step) or evaluates_after(cfg, step)) and step > progress.start_step
        deadline = ctl.hang.deadline(ctl.rows.recent_step_times(HANG_WINDOW)) if plain else cfg.fault.step_timeout_s
        progress.waiting_for(step, refs, upcoming)
        answers = await ctl.group.call(refs, f"step {step}", deadline, hang=plain, next_calls=upcoming)
        now = time.perf_counter()
        progress.step_timed(step, now - start)
        record_figures(ctl, answers)
        start, refs, done = now, upcoming, step + 1
        progress.step_began()
        if not refs:
            break
    # The last step's figures, read (and checked for divergence) before the final checkpoint, a stop or a resize.
    progress.waiting_for(done, [], [])
    record_figures(ctl, await ctl.group.call([w.flush.remote() for w in ctl.group.workers],
                                             f"reading step {done - 1}'s figures"))
    progress.stopped_at(done)
    return AtBoundary(done, saved=saves_after(cfg, done - 1) and progress.checkpoint_failures == 0)


def record_figures(ctl: Controller, answers: list[list[dict]]) -> None:
    """The rows of the steps whose figures one call to every rank returned (each rank returns the same steps,
    `RankDriver.queue_step`), in step order, each timed by its own step's call."""
    cfg = ctl.plan.config
    by_step: dict[int, list[dict]] = {}
    for finished in answers:
        for stats in finished:
            by_step.setdefault(stats["step"], []).append(stats)
    for step, results in sorted(by_step.items()):
        row = make_row(step, results, ctl.progress.timed.pop(step), cfg.global_batch * cfg.model.seq_len,
                       cfg.planned.predicted_step_s if cfg.planned else None)
        record(ctl, row, results)


def record(ctl: Controller, row: dict, results: list[dict] | None = None) -> None:
    """A finished step: its checkpoint event, the recovery it ends, the replicas it gave back (local_sgd,
    diloco: from the ranks' `results`, the steps each replica holds, and the rejoin of a dropped one), its row,
    the gauges."""
    from trainyard.parallel.plan.replica_sync import is_local

    plan, progress = ctl.plan, ctl.progress
    if results is not None:  # by the rank each answer names: after a replica drop, not every rank answers
        ctl.rank_peaks.update({plan.rank_of(r["pp_rank"], r["tp_rank"], r["dp_rank"]): r["peak_rss_bytes"]
                               for r in results if "peak_rss_bytes" in r and "pp_rank" in r})
    if results is not None and is_local(plan.parallel.sync) and plan.dp > 1:
        stepped = {r["dp_rank"] for r in results if not r.get("sat_out")}
        back = progress.replicas_stepped(row["step"], plan.dp, stepped)
        if back:
            ctl.journal.add_event({"time": time.time(), "kind": "replica_rejoined", "step": row["step"] + 1,
                                   "replicas": list(back), "steps_missed": list(back.values())})
        row["replica_steps"] = list(progress.replica_steps)
    for event in (compile_event(row), checkpoint_event(row)):
        if event is not None:
            ctl.journal.add_event(event)
    if "checkpoint_blocked_s" in row or "checkpoint_error" in row:
        _checkpoint_written(ctl, row)
    if (failed_at := progress.recovered()) is not None:
        now = time.time()
        ctl.journal.add_event({"time": now, "kind": "recovered", "step": row["step"] + 1,
                               "recovery_s": now - failed_at, "failure": len(ctl.journal.causes)})
    ctl.rows.add(row)
    set_gauges(ctl.job_id, row, ctl.plan.config.steps)


def _checkpoint_written(ctl: Controller, row: dict) -> None:
    """A scheduled checkpoint written, or not: a failed write is an event, and `checkpoint.max_write_failures`
    of them in a row fail the job (before that it trains on, from the checkpoints it has, and tries again)."""
    error = row.get("checkpoint_error")
    in_a_row = ctl.progress.checkpoint_written(ok=error is None)
    if error is None:
        return
    limit = ctl.plan.config.checkpoint.max_write_failures
    ctl.journal.add_event({"time": time.time(), "kind": "checkpoint_failed", "step": row["step"] + 1,
                           "error": error, "in_a_row": in_a_row})
    log.warning("job %s: %s (%d in a row, of checkpoint.max_write_failures=%d)", ctl.job_id, error, in_a_row, limit)
    if in_a_row >= limit:
        raise Unrecoverable(f"{in_a_row} checkpoints in a row could not be written (checkpoint.max_write_failures="
                            f"{limit}); the last: {error}")


async def finish(ctl: Controller, steps_done: int, saved: bool) -> Outcome:
    """The final checkpoint, then (unless the service suspends the job) the model consolidated from it into one
    safetensors file."""
    root, cfg, plan = ctl.storage.checkpoint_root, ctl.plan.config, ctl.plan
    # Stopped while a replica sat out (local_sgd, diloco): the live replicas sync, and the others take a live
    # one's state, as at a rejoin, so the checkpoint is one model.
    live = ctl.progress.take_dropped(plan.dp)
    await ctl.group.call([w.final_checkpoint.remote(root, steps_done, checkpoint_info(cfg), saved, live)
                          for w in ctl.group.workers], "the final checkpoint")
    if ctl.suspend:
        return Done()
    directory = checkpoint.step_dir(Path(root), steps_done)
    for rank in ctl.drills.in_export():  # the drill: a rank's process dies as the model is exported
        log.warning("job %s: fault drill kill_worker_in_export on rank %d", ctl.job_id, rank)
        ray.kill(ctl.group.workers[rank], no_restart=True)
    # Rank 0 exports: it has torch loaded, and the coordinator need not import it as the job ends. Through the
    # group's call, as every call to the ranks: a death there (its node lost as the job ends) is a failure that
    # is recovered from (the final checkpoint, then the export again), not the coordinator's own error (which
    # failed the job, with a traceback, once the soak removed a node during an export).
    [exported] = await ctl.group.call([ctl.group.workers[0].export_model.remote(str(directory), steps_done,
                                                                                ctl.storage.model_path)],
                                      "the model's export")
    path = Path(exported)
    log.info("job %s: model after step %d exported to %s", ctl.job_id, steps_done, path)
    return Done(model={"path": str(path), "step": steps_done})


class Drills:
    """Fault drills still to run: kind, rank, at_step. Worker drills go with the rank's step call;
    `kill_coordinator` exits this process; `kill_worker_in_recovery` kills the rank while the ranks take the
    job's state in the next recovery at or after `at_step` (a failure during a recovery); `kill_worker_in_export`
    kills it as the model is exported at the job's end."""

    COORDINATOR_SIDE = ("kill_coordinator", "kill_worker_in_recovery", "kill_worker_in_export")

    def __init__(self) -> None:
        self.pending: list[dict] = []

    def add(self, kind: str, rank: int, at_step: int) -> None:
        self.pending.append({"kind": kind, "rank": rank, "at_step": at_step})

    def due_on_ranks(self, step: int) -> dict[int, str]:
        """The workers' drills due at `step`, by rank; each runs once."""
        due = [d for d in self.pending if d["at_step"] <= step and d["kind"] not in self.COORDINATOR_SIDE]
        self.pending = [d for d in self.pending if d not in due]
        return {d["rank"]: d["kind"] for d in due}

    def kills_coordinator(self, step: int) -> bool:
        """A kill_coordinator drill is due as the coordinator waits for `step` (its restart has no drills)."""
        return any(d["kind"] == "kill_coordinator" and d["at_step"] <= step for d in self.pending)

    def in_recovery(self, step: int) -> list[int]:
        """The ranks to kill in the recovery under way (which restores `step`); each drill runs once."""
        due = [d for d in self.pending if d["kind"] == "kill_worker_in_recovery" and d["at_step"] <= step]
        self.pending = [d for d in self.pending if d not in due]
        return [d["rank"] for d in due]

    def in_export(self) -> list[int]:
        """The ranks to kill as the model is exported; each drill runs once."""
        due = [d for d in self.pending if d["kind"] == "kill_worker_in_export"]
        self.pending = [d for d in self.pending if d not in due]
        return [d["rank"] for d in due]
