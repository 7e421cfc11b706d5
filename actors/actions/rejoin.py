"""The end of every recovery and resize (steps 3 to 5 of `actors.actions.recovery`'s sequence): the missing ranks
created, every rank set up in the new process groups, the job's state taken (a checkpoint loaded, or moved in
memory between the ranks), and the rows that will be run again forgotten."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray
from trainyard.actors.progress import Progress
from trainyard.actors.state import Point
from trainyard.actors.telemetry import Rows
from trainyard.actors.worker_group.worker_group import WorkerGroup

log = logging.getLogger("trainyard.coordinator")


class Rejoin:
    def __init__(self, job_id: str, group: WorkerGroup, progress: Progress, rows: Rows):
        self.job_id, self.group, self.progress, self.rows = job_id, group, progress, rows

    async def __call__(self, restore: Point | None, in_memory: bool, sources: dict[int, int] | None = None,
                       kill_in_recovery: Sequence[int] = ()) -> None:
        """`restore`: the checkpoint to load (None: the start, or the state moves in memory); `sources`: in memory,
        the rank each rank takes the state from by broadcast (None: each keeps its own); `kill_in_recovery`: the
        ranks a fault drill kills as the state is taken."""
        group = self.group
        await group.start()
        for rank in kill_in_recovery:  # the drill: a rank's process dies as the ranks take the state
            log.warning("job %s: fault drill kill_worker_in_recovery on rank %d", self.job_id, rank)
            ray.kill(group.workers[rank], no_restart=True)
        if in_memory:
            await group.call([w.adopt_state.remote(self.progress.start_step, sources[r] if sources else None)
                              for r, w in enumerate(group.workers)], "moving the state")
        else:
            await group.load(restore)
        self.rows.trim(self.progress.start_step)
