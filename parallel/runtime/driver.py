"""One rank of a job driven with torch.distributed alone: join the plan's process groups, build the
`RankTrainer`, run steps on this rank's micro-batches, evaluate, save and load checkpoints, leave.

A step's figures reach the caller one step late (`queue_step`): the call for step N queues N's work and returns
N-1's, read once N's work is queued behind them, so the device never waits for the host between steps; `flush`
gives the last step's. A step that evaluates or saves is read (and checked for divergence) in its own call.

The one place this sequence is written: the service's Worker actor (actors/worker_group/worker.py) is a Ray shell
around a `RankDriver`, and the gloo tests and the benches run the same driver in spawned processes
(`parallel.runtime.local_world`). No Ray here.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from trainyard.parallel.data.datasets import open_dataset
from trainyard.parallel.data.examples import epoch_of
from trainyard.parallel.data.sampler import step_microbatches
from trainyard.parallel.io.checkpoint import CheckpointWriteError
from trainyard.parallel.plan import Plan
from trainyard.parallel.plan.memory.estimate import estimate
from trainyard.parallel.runtime.distributed import RankGroups, init_distributed, pick_device, shutdown_distributed
from trainyard.parallel.runtime.host_memory import return_freed_memory, returns_freed_memory
from trainyard.parallel.runtime.step.step_figures import Figures
from trainyard.parallel.runtime.step.step_stats import Save
from trainyard.parallel.runtime.trainer import RankTrainer

RECENT = 4
"""How many steps' figures a rank keeps after reading them (a recovery needs the last two at most)."""


class RankDriver:
    """This rank's process groups and trainer, from `init_distributed` to `close`."""

    def __init__(self, plan: Plan, rank: int, master_addr: str, master_port: int,
                 device: torch.device | None = None, timeout_s: float | None = None, init_method: str | None = None):
        self.plan, self.rank = plan, rank
        self.device = pick_device(plan.gpus_per_worker) if device is None else device
        # Before the trainer allocates: its large tensors then never come from glibc's heaps (a large rank only).
        predicted = estimate(plan.layout, plan.config)[rank]
        on_gpu = self.device.type == "cuda"
        if returns_freed_memory(max(predicted.host, predicted.startup) if on_gpu else predicted.resident(False)):
            return_freed_memory()
        timeout = plan.config.fault.step_timeout_s if timeout_s is None else timeout_s
        self.groups: RankGroups = init_distributed(plan, rank, master_addr, master_port, self.device,
                                                   timeout_s=timeout, init_method=init_method)
        self.trainer = RankTrainer(plan, rank, self.groups, self.device)
        self._num_samples: int | None = None
        self._queued: tuple[Figures | None, dict] | None = None
        """The step queued last whose figures the caller has not had: its `Figures` (None once read, or for a step
        this rank sat out or only rejoined at) and what its dict already holds."""
        self.recent: deque[dict] = deque(maxlen=RECENT)
        """The figures of the last steps read here, returned or not (a failed call's are lost with it: a
        recovery asks for them, `Worker.keep_state`)."""

    def trainer_for(self, plan: Plan) -> RankTrainer:
        """Another trainer on this driver's process groups, for a plan of the same layout (a bench runs variants
        side by side, their steps interleaved)."""
        assert plan.world_size == self.plan.world_size and plan.coords(self.rank) == self.plan.coords(self.rank)
        return RankTrainer(plan, self.rank, self.groups, self.device)

    @property
    def num_samples(self) -> int:
        if self._num_samples is None:
            self._num_samples = open_dataset(self.plan.config).num_samples
        return self._num_samples

    def microbatches(self, step: int) -> list[list[int]]:
        """This rank's micro-batch sample ids in `step` (what the coordinator sends a worker)."""
        return step_microbatches(self.plan, self.rank, step, self.num_samples)

    def queue_step(self, step: int, microbatch_ids: list[list[int]] | None = None, *, evaluate: bool = False,
                   save: Save | None = None, round_: dict | None = None) -> list[dict]:
        """Step `step`'s work queued (on this rank's own share of the step's batch unless `microbatch_ids` are
        given); returns the figures of the steps finished since the last call, in step order: the previous step's,
        read now that this step's work is queued behind them (one step late), and this step's too when it
        evaluates or saves, since the validation loss and a checkpoint of the state after it come once its figures
        are read and checked (a checkpoint is never written after a diverged step). Each is the StepStats as a
        dict, with `val_loss` and `checkpoint_blocked_s` (how long the save blocked) when they were asked for, or
        `checkpoint_error` when the checkpoint could not be written (every rank says so alike); `flush` gives
        the last step's. Every rank returns the same steps.
        `round_` (local_sgd, diloco, while a replica is dropped: `replica_sync.round_of`): the `live` replicas
        step; one `rejoining` at this step's sync takes part in it, then takes the state of the lowest live
        replica; any other sits the step out (its answer says so: `sat_out`)."""
        ids = self.microbatches(step) if microbatch_ids is None else microbatch_ids
        mine = self.plan.coords(self.rank)
        live, rejoining = (None, ()) if round_ is None else (tuple(round_["live"]), tuple(round_["rejoining"]))
        queued: Figures | None = None
        sat_out = live is not None and mine.dp not in live + rejoining
        if sat_out:
            stats: dict[str, Any] = {"step": step, "dp_rank": mine.dp, "sat_out": True}
        elif mine.dp in rejoining:
            assert live is not None  # rejoining is only ever named with the live replicas
            sent = self.trainer.sit_in_sync(step, live)
            stats = {"step": step, "dp_rank": mine.dp, "rejoined": True, "cross_replica_bytes": sent}
        else:
            queued, stats = self.trainer.queue_step(step, ids, live), {}
        if not sat_out and self.plan.config.data.packing is not None:  # whole examples: which, how far into epochs
            stats["sample_ids"] = [i for mb in ids for i in mb]
            stats["epoch"] = epoch_of(step, self.plan.config.global_batch, self.num_samples)
        if rejoining and not sat_out:
            assert live is not None
            source = self.plan.rank_of(mine.pp, mine.tp, min(live))
            self.trainer.take_replica_state(step + 1, source, receiving=mine.dp in rejoining)
        finished = self.flush()
        self._queued = (queued, stats)
        if not (evaluate or save is not None):
            return finished
        finished += self.flush()
        if sat_out:
            return finished
        if evaluate:
            finished[-1]["val_loss"] = self.trainer.evaluate()
        if save is not None:
            try:
                finished[-1]["checkpoint_blocked_s"] = self.save(save, step + 1)
            except CheckpointWriteError as e:  # the job goes on; the coordinator counts the failures in a row
                finished[-1]["checkpoint_error"] = str(e)
        return finished

    def flush(self) -> list[dict]:
        """The figures of the step queued last, read now ([] when there is none): at the job's end, a stop or a
        resize; a step's that diverged raise `DivergedError`, naming it."""
        stats = self._read_queued()
        self._queued = None
        if stats is None:
            return []
        self.recent.append(stats)
        return [stats]

    def _read_queued(self) -> dict | None:
        """The queued step's figures, read to the host if they are not yet (kept for `flush` to return)."""
        if self._queued is None:
            return None
        queued, stats = self._queued
        if queued is not None:
            self._queued = None  # one that diverged raises: there is nothing left to read again
            stats = {**self.trainer.read_step(queued).to_dict(), **stats}
            self._queued = (None, stats)
        return stats

    def step(self, step: int, microbatch_ids: list[list[int]] | None = None, *, evaluate: bool = False,
             save: Save | None = None, round_: dict | None = None) -> dict:
        """One step with its figures read at once (`queue_step`, then `flush`): its dict, as `queue_step` says."""
        finished = self.queue_step(step, microbatch_ids, evaluate=evaluate, save=save, round_=round_) + self.flush()
        assert finished[-1]["step"] == step
        return finished[-1]

    def run(self, steps: range, *, save_after: tuple[int, ...] = (), save: Save | None = None,
            evaluate_after: tuple[int, ...] = ()) -> list[dict]:
        """`steps` in order, as the service's ranks run them (each step's figures read one step late), saving the
        state after each step whose count is in `save_after` and taking the validation loss after each one whose
        count is in `evaluate_after`; every save is finished and committed at the end. The steps' dicts."""
        out = [stats for s in steps for stats in self.queue_step(
            s, evaluate=s + 1 in evaluate_after, save=save if s + 1 in save_after else None)]
        out += self.flush()
        self.trainer.finish_checkpoint()
        return out

    def save(self, save: Save, steps_done: int) -> float:
        """Checkpoint `steps_done` (collective); the seconds the caller was blocked. A step queued and not yet read
        is read (and checked) first."""
        self._read_queued()
        start = time.perf_counter()
        self.trainer.save_checkpoint(Path(save.root), steps_done, save.info, background=save.background)
        return time.perf_counter() - start

    def load(self, directory: Path, step: int) -> None:
        """Take parameters and optimizer state from the checkpoint of `step` (any layout may have written it)."""
        self.trainer.load_checkpoint(Path(directory), step)

    def final_checkpoint(self, root: Path, steps_done: int, info: dict, saved: bool,
                         live: tuple[int, ...] | None = None) -> float:
        """The state at the job's end as a checkpoint (unless the last step just saved it), every save finished
        and committed; the seconds it took. `live`: local_sgd, diloco while replicas sit out, the others (see
        `RankTrainer.save_checkpoint`)."""
        self._read_queued()  # never after a diverged step (the coordinator flushed already: nothing to read)
        start = time.perf_counter()
        if self.trainer.server is not None:
            # parameter_server: every rank's pushes are applied by now (each collected its own before its last
            # pull); under SSP and ASP that pull may have come before a peer's, so the state saved (and the model
            # exported from it) is the shards' parameters, pulled again.
            self.trainer.server.pull(steps_done)
        if not saved:
            self.trainer.save_checkpoint(Path(root), steps_done, info, live=live)
        self.trainer.finish_checkpoint()
        return time.perf_counter() - start

    def close(self) -> None:
        """Leave the process groups (a new `RankDriver` may then join another rendezvous in this process)."""
        shutdown_distributed()
