"""The one recovery-and-resize sequence, for every cause: a failed step, a failure during a recovery or a
resize, a lost node (elastic jobs shrink to the replicas left), the coordinator's own death (every rank
died with it), and a resize asked for (`scale` or the elastic grower).

  1. leave the old layout: after a failure, ranks that raised are reset and kept, the others killed; for a
     resize, the kept ranks hold their state in memory (or it goes through a checkpoint of this step)
     after a failure, whatever its cause, bundles on no live node (a lost node) wait up to fault.node_grace_s
     to be placed again; then an elastic job shrinks to the replicas left, a fixed-size one fails naming the node
  2. take the new layout, if any: kept ranks renumbered, removed ones killed, slots moved
  3. create the missing ranks, rendezvous, set every rank up
  4. take the state: load the restore point, or move it in memory (new ranks get it by broadcast); after a
     failure, when every (pp, tp) shard still has a data-parallel replica holding the state of the failed step
     (`failure_handling.replicas.replica_sources`; the failed step is the first without a row: figures come one
     step late), or of a later one whose figures the ranks returned or kept (`replicas.live_point`), that replica
     is the source: the job resumes there, no step lost and no checkpoint read (torchft's idea); else it goes
     back to the restore point
  5. forget the metrics rows that will be run again, and record the resize
`Recovery` runs it; steps 3 to 5 are `actions.rejoin`'s. local_sgd and diloco jobs may instead drop the failed
replica from the round (`actions.replica_drop`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from trainyard.actors.actions.rejoin import Rejoin
from trainyard.actors.actions.replica_drop import ReplicaDrop
from trainyard.actors.actions.requests import Drills
from trainyard.actors.calls import Failure, Unrecoverable
from trainyard.actors.failure_handling.replicas import live_point, replicas_may_recover
from trainyard.actors.journal import Journal
from trainyard.actors.progress import Progress
from trainyard.actors.scaling_policy.scaling import largest_size
from trainyard.actors.state import Ready, Recovering, Resizing
from trainyard.actors.storage import JobStorage, checkpoint_info
from trainyard.actors.telemetry import Rows, figures_by_step, make_row
from trainyard.actors.worker_group.worker_group import WorkerGroup, dead_nodes
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import Plan, can_move_in_memory, resize_plan
from trainyard.parallel.plan.cadence import saves_after
from trainyard.parallel.runtime.step.step_stats import StepReport

log = logging.getLogger("trainyard.coordinator")


class Recovery:
    def __init__(self, job_id: str, storage: JobStorage, group: WorkerGroup, progress: Progress, rows: Rows,
                 journal: Journal, drills: Drills, rejoin: Rejoin, replica_drop: ReplicaDrop):
        """`rows`: the rows of the steps a failure cut short are added from the ranks' figures; `replica_drop`:
        tried first (local_sgd, diloco)."""
        self.job_id, self.storage, self.group, self.progress, self.rows = job_id, storage, group, progress, rows
        self.journal, self.drills, self.rejoin, self.replica_drop = journal, drills, rejoin, replica_drop

    async def recover(self, state: Recovering) -> Ready:
        """Bring the job back after a failure, from `state.restore` (local_sgd, diloco: or drop the failed replica
        from the round, the others going on: `ReplicaDrop`)."""
        if await self.replica_drop(state):
            return Ready()
        group, progress = self.group, self.progress
        failure, old = state.failure, group.plan
        began = time.time()
        live = state.counted and replicas_may_recover(old)  # a node lost for good may shrink the job: checkpoint
        kept = await group.tear_down(failure, progress.upcoming, keep_state=live)
        # Any failure may have come with a lost node (a rank's death, or the coordinator's: its restarted
        # incarnation finds the bundles unplaced), whatever the failure policy made of it.
        shrunk = await self._ride_node_loss(failure)
        answered = _answers(old, failure, kept)
        steps = {rank: held for rank, (held, _) in kept.items()}
        point = live_point(old, steps, failure.step, answered) if live and shrunk is None else None
        sources = point[0] if point else None
        # The steps before it that did finish but whose rows the coordinator lacks (figures come a step late, or
        # the answer was lost with the rank that died): their rows from the figures the ranks returned or kept.
        for step in range(failure.step, point[1] if point else failure.step):
            cfg = old.config
            self.rows.add(make_row(step, list(answered[step]), progress.timed.get(step, failure.waited_s),
                                   cfg.global_batch * cfg.model.seq_len))
        self._record_failure(state, point[1] if point else None)
        if shrunk is not None:  # an elastic job lost a node for good: go on with the replicas left
            new, replicas = shrunk
            group.keep_replicas(replicas, new)
        await self.rejoin(None if sources else state.restore, in_memory=sources is not None, sources=sources,
                          kill_in_recovery=self.drills.in_recovery(failure.step))
        if shrunk is not None:
            self._resize_event(old, group.plan, "node lost", began, began, "checkpoint")
        return Ready()

    async def resize(self, state: Resizing) -> Ready:
        """Go to the layout `state.plan` between two steps: ranks whose (pp, tp, dp) coordinates remain keep their
        actor (and, when `can_move_in_memory`, their state: new ranks get it by broadcast from data-parallel rank
        0), removed ranks are killed, added ones created on their reserved bundles; every rank joins new process
        groups. Otherwise the state goes through a checkpoint of this step."""
        group = self.group
        old, new, step = group.plan, state.plan, self.progress.start_step
        began = time.time()
        in_memory = can_move_in_memory(old, new)
        kept = {r: new.rank_of(c.pp, c.tp, c.dp) for r in range(old.world_size) if (c := old.coords(r)).dp < new.dp}
        workers = group.workers
        if in_memory:
            await group.call([workers[r].keep_state.remote() for r in kept], "keeping the state")
            restore = None
        else:
            root, saved = self.storage.checkpoint_root, saves_after(old.config, step - 1)
            await group.call([w.final_checkpoint.remote(root, step, checkpoint_info(old.config), saved)
                              for w in workers], f"the checkpoint of step {step} for a resize")
            await group.call([workers[r].reset.remote() for r in kept], "leaving the process groups")
            restore = (str(checkpoint.step_dir(Path(root), step)), step)
        group.take(new, kept)
        group.move_slots(new)
        sources = {r: new.rank_of(new.coords(r).pp, new.coords(r).tp, 0) for r in range(new.world_size)}
        await self.rejoin(restore, in_memory=in_memory, sources=sources if new.dp > old.dp else None)
        self._resize_event(old, new, state.reason, state.asked, began, "memory" if in_memory else "checkpoint")
        return Ready()

    def _record_failure(self, state: Recovering, replica_step: int | None) -> None:
        """The failure as an event (and, when counted, its cause against fault.max_failures); the job goes on from
        a live replica at the failed step, or from the restore point. Recovery time counts from the failure."""
        failure, restore, journal = state.failure, state.restore, self.journal
        if state.counted:
            journal.add_cause(failure.cause)
        restore_step = replica_step if replica_step is not None else restore[1] if restore else 0
        source = "replica" if replica_step is not None else "checkpoint" if restore else "start"
        self.progress.resumed_at(restore_step, failure.failed_at)
        blamed = list(failure.blamed)
        journal.add_event({
            "time": failure.failed_at, "kind": "failure", "cause": failure.cause, "ranks": blamed,
            "waited_s": failure.waited_s, "nodes": sorted({self.group.rank_info(r).get("node", "") for r in blamed}),
            "step": failure.step, "steps_lost": max(0, failure.step - restore_step), "restore_step": restore_step,
            "recovered_from": source, "failure": len(journal.causes),
        })
        log.warning("job %s: failure %d (%s); recovering from step %d (%s)", self.job_id, len(journal.causes),
                    failure.cause.splitlines()[0], restore_step, source)

    async def _ride_node_loss(self, failure: Failure) -> tuple[Plan, list[int]] | None:
        """When bundles of the job are on no live node (a node was lost), wait up to fault.node_grace_s for Ray to
        place them again (on a node added back, or room elsewhere): then nothing changes (None). Else an elastic
        job goes on with the replicas whose bundles are all placed (the layout and those replicas; riding node
        churn is what elastic jobs are for, so a failure the policy saw as a lost node is not counted against
        fault.max_failures); a fixed-size job fails, naming the lost node."""
        group, old = self.group, self.group.plan
        lost = group.lost_replicas()
        if not lost:
            return None
        grace = old.config.fault.node_grace_s
        # The nodes the lost replicas ran on; a restarted coordinator never set its ranks up: the nodes Ray lists
        # as dead.
        nodes = ", ".join(group.nodes_of(lost) or dead_nodes()) or "unknown"
        self.journal.add_event({"time": time.time(), "kind": "node_lost", "nodes": nodes, "replicas": sorted(lost),
                                "grace_s": grace})
        log.warning("job %s: replicas %s lost their node (%s); waiting up to fault.node_grace_s=%g s for its "
                    "resources", self.job_id, sorted(lost), nodes, grace)
        deadline = time.monotonic() + grace
        while lost and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            lost = group.lost_replicas()
        if not lost:
            log.info("job %s: the lost node's resources are back: going on at the same size", self.job_id)
            return None
        if old.dp_range is None:
            raise Unrecoverable(f"{failure.cause}\nThe node {nodes} was lost and its resources did not come back "
                                f"within fault.node_grace_s={grace:g} s: this job needs all of its {old.world_size} "
                                "ranks (an elastic parallel.dp {min, max} would go on with the replicas left)")
        kept = [d for d in range(old.dp) if d not in lost]
        size = largest_size(old, len(kept))
        if size is None:
            raise Unrecoverable(f"{failure.cause}\nThe node {nodes} was lost and its resources did not come back "
                                f"within fault.node_grace_s={grace:g} s; the {len(kept)} replicas left are fewer than "
                                f"parallel.dp.min={old.dp_range[0]}")
        return resize_plan(old, size), kept[:size]

    def _resize_event(self, old: Plan, new: Plan, reason: str, asked: float, began: float, moved: str) -> None:
        layout = lambda p: {"dp": p.dp, "microbatches": p.microbatches, "world_size": p.world_size}  # noqa: E731
        step = self.progress.start_step
        self.journal.add_event({"time": began, "kind": "resize", "reason": reason, "step": step,
                                "from": layout(old), "to": layout(new), "moved": moved,
                                "paused_s": time.time() - began, "waited_s": began - asked})
        log.info("job %s: resized dp %d -> %d at step %d (%s, state moved through %s)", self.job_id, old.dp,
                 new.dp, step, reason, moved)


def _answers(plan: Plan, failure: Failure, kept: dict[int, tuple[int | None, list[StepReport]]]
             ) -> dict[int, tuple[StepReport, ...]]:
    """The figures the ranks returned or kept for the steps from the failed one on (no row has them yet), by
    step: those in the answers that came back, and those the failure cut short (each kept rank's last figures
    read, `Worker.keep_state`)."""
    return figures_by_step(plan, [*failure.answered, *(last for _, last in kept.values())], failure.step)
