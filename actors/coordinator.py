"""The Coordinator actor: one per job, a thin Ray shell around the job's `Controller` (actors.controller).

Life of a job, as the controller drives it (the service's admission loop has already reserved the job's
placement group, all or nothing, and hands it over ready; the service removes it when the job ends):
  PENDING     the point to start from is verified (its hashes, in a thread)
  RUNNING     one Worker per rank on its bundle, rendezvous, then the steps (one Ray call per worker per step)
  RECOVERING  a step (or a recovery, or a resize) failed: the ranks come back from the latest checkpoint
  RESIZING    the job moves to another data-parallel size between two steps
  SUCCEEDED / STOPPED / FAILED   once the workers and the grown placement groups are released

It is an async actor so that `poll`, `stop` and `scale` are answered while a step runs. A step fails when a
worker raises, dies, or hangs (`actors.failure_handling.hang`); up to `fault.max_failures` failures, wherever
they happen, are recovered from (`actors.actions.recovery`), the next one fails the job with every cause.

The coordinator's own death is a failure too: the service creates it with Ray `max_restarts =
fault.max_failures`, its workers die with it (Ray fate-shares actors with their owner), and Ray starts it
again with the same arguments. The new incarnation reads what its predecessor appended beside the
checkpoints (`actors.journal`), counts the failure, and recovers like any other. It starts on the service's
next poll, since nobody calls `start` again. It starts from the admitted layout, so it first removes the
placement groups its predecessor reserved to grow (`worker_group.remove_grown_placement_groups`).
"""

from __future__ import annotations

import asyncio
import logging
import warnings

import ray
from ray.util.placement_group import PlacementGroup
from trainyard.actors.controller import Controller
from trainyard.actors.storage import JobStorage, checkpoint_info
from trainyard.actors.worker_group.worker_group import remove_grown_placement_groups
from trainyard.parallel.plan import Plan

__all__ = ["Coordinator", "JobStorage", "checkpoint_info"]

STOP_GRACE_S = 8.0
"""How long a stop waits for the step under way, the final checkpoint and the export before it cancels
(within the service's 10 s shutdown bound)."""


@ray.remote(num_cpus=0)
class Coordinator:
    def __init__(self, job_id: str, plan: Plan, pg: PlacementGroup, storage: JobStorage):
        """`pg` is the job's placement group, already reserved: one bundle per tensor-parallel group;
        `storage` says where checkpoints and the trained model go, and which checkpoint to start from."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.job_id = job_id
        self.restarted = _was_restarted()
        """Ray restarted this actor after its process died: the job recovers from its journal."""
        self.controller = Controller(job_id, plan, pg, storage, self.restarted)
        if self.restarted:  # it starts from the admitted layout: what its predecessor grew into is not its own
            removed = remove_grown_placement_groups(job_id)
            if removed:
                logging.getLogger("trainyard.coordinator").warning(
                    "job %s: removed the placement groups the coordinator before this one reserved to grow: %s",
                    job_id, ", ".join(removed))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.controller.run())

    async def poll(self, since: int = 0, events_from: int | None = None) -> dict:
        """Status, error, the metrics rows of steps >= `since` and the events from index `events_from` (every
        event when None; `incarnation` says which list the index counts in). A restarted coordinator starts
        here."""
        if self.restarted:
            await self.start()
        return self.controller.report(since, events_from)

    async def stop(self, grace_s: float = STOP_GRACE_S, suspend: bool = False, since: int = 0) -> dict:
        """End the run at the next step boundary, with a final checkpoint and the model exported; if that
        takes longer than `grace_s` (a hung step), cancel it. Returns the final poll (the metrics rows of steps
        >= `since`: those the service has not read yet). `suspend`: the service is going down, the job is not
        over: the final checkpoint is what it goes on from later; no model."""
        if self.restarted:  # a restarted coordinator the service has not polled yet: it recovers, then stops
            await self.start()
        if self._task is not None and not self._task.done():
            self.controller.request_stop(suspend)
            done, _ = await asyncio.wait({self._task}, timeout=grace_s)
            if not done:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        return self.controller.report(since)  # (`start_step` is now the stop's step: no row is at or after it)

    async def scale(self, dp: int, reason: str = "request") -> dict:
        """Go to `dp` data-parallel replicas at the next step boundary; the resources of added ranks are
        reserved first. Returns the new layout, or why the resize is refused now."""
        return await self.controller.request_resize(dp, reason)

    async def inject(self, kind: str, rank: int, at_step: int, factor: float = 3.0) -> None:
        """A fault drill: `kind` happens to `rank` when it starts step `at_step` (or the first step after);
        `factor`: slow_rank's slow-down."""
        self.controller.drills.add(kind, rank, at_step, factor)

    async def add_event(self, event: dict) -> None:
        """An event the service saw (e.g. it reattached to this job after a restart)."""
        self.controller.journal.add_event(event)

    def actor_names(self) -> list[str]:
        return self.controller.group.actor_names()


def _was_restarted() -> bool:
    with warnings.catch_warnings():  # Ray marks the property deprecated but offers no replacement for it
        warnings.simplefilter("ignore")
        return ray.get_runtime_context().was_current_actor_reconstructed
