"""The state of one rank that moves: into and out of checkpoints, between replicas, and across a resize.

A `RankState` owns the checkpoint's form of a rank's state (`checkpoint_state`: parameters and their optimizer
state under the unsharded model's names, and diloco's outer momentum), the checkpoint's writes (a background save
waiting to be committed), the step count the state holds (`steps_done`), and every way that state is replaced:
loading a checkpoint, adopting in-memory state after a resize or from a live replica, a rejoining replica's
broadcast, and local_sgd / diloco's averaging (`sync_replicas`). It holds the trainer's parts (chunks, reducers,
optimizer, replica sync) but builds none of them: `parallel.runtime.trainer.RankTrainer` builds them, runs the
steps, and delegates its state-moving methods here. A plain object the trainer holds, rather than a mixin, so
what it reads of the trainer is its constructor's arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from trainyard.parallel.io import checkpoint
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.plan import Plan
from trainyard.parallel.plan.layout import RankCoords
from trainyard.parallel.plan.sync.replica_sync import averages_optimizer_state, syncs_before_save
from trainyard.parallel.runtime.distributed import RankGroups
from trainyard.parallel.runtime.dp.data_parallel import Reducer
from trainyard.parallel.runtime.pipeline.tied import TiedEmbeddings
from trainyard.parallel.runtime.pipeline.weight_versions import WeightVersions
from trainyard.parallel.runtime.sync import ReplicaSync, saved_outer_state
from trainyard.parallel.runtime.tp.local_parts import local_part
from trainyard.parallel.runtime.train_optimizer import StateView, TrainOptimizer


class RankState:
    def __init__(self, plan: Plan, rank: int, groups: RankGroups, chunks: list[DecoderStage],
                 reducers: dict[str, Reducer], optimizer: TrainOptimizer,
                 sync: ReplicaSync | None, tied: TiedEmbeddings):
        """`sync`: local_sgd / diloco's replica sync (None: the replicas step together, or dp = 1). `tied`: the
        copies of a tied embedding, which checkpoints see as one tensor."""
        self.plan, self.rank, self.groups, self.tied = plan, rank, groups, tied
        self.coords: RankCoords = plan.coords(rank)
        self.chunks, self.reducers, self.optimizer, self.sync = chunks, reducers, optimizer, sync
        self._sync_names = [name for chunk in chunks for name, p in chunk.named_parameters() if p.requires_grad]
        self._head_moments: dict[str, torch.Tensor] | None = None
        """The tied head copy's moments from `checkpoint_state`, where the embedding stands for it on this rank."""
        self._view: StateView | None = None
        """The optimizer state `checkpoint_state` exported, until a load fills it and `_took_state` takes it back."""
        self._pending_checkpoint: tuple[Callable[[], None], Path, int] | None = None
        self.versions: WeightVersions | None = None
        """2bw's older weight version (`parallel.runtime.pipeline.weight_versions`), set by the trainer."""
        self.steps_done: int | None = 0
        """The steps the parameters and moments hold; None while they are being replaced or stepped (a failure
        then leaves them half-done), so a recovery takes state only from a rank that knows its step."""

    def checkpoint_state(self) -> dict:
        """This rank's part of a checkpoint (see parallel.io.checkpoint): its parameters and their optimizer state
        (AdamW's moments, or another kind's state in that form: `parallel.optim.states`), under the
        unsharded model's names and in the parameters' shapes."""
        # A frozen parameter (LoRA's base) is not saved: it never changes, and comes back from init_from or the seed.
        self.optimizer.settle()  # offload overlapped: the last step's host steps done (`parallel.runtime.host_steps`)
        names = {p: name for p, name in self.tied.state_names(self.chunks).items() if p.requires_grad}
        self._view = view = self.optimizer.export()
        state_keys = self.optimizer.kind.state
        moments = {p: m for r in self.reducers.values() for p, m in r.moments(view.state, state_keys).items()}
        self._head_moments = moments.pop(self.tied.head) if self.tied.head is not None and self.tied.local else None
        state = {"model": {name: p for p, name in names.items()}, "optim": {names[p]: m for p, m in moments.items()}}
        outer = self.sync.outer_state() if self.sync is not None else []
        if outer:  # diloco's outer momentum; its anchor is the parameters, as checkpoints are taken at syncs
            state["sync"] = dict(zip(self._sync_names, outer, strict=True))
        return state

    def sit_in_sync(self, step: int, live: tuple[int, ...]) -> int:
        """A rejoining replica's part of the sync after `step`, which it did not step: it adds nothing to the
        averages (`ReplicaSync.synchronise`); `take_replica_state` then gives it the result. The bytes sent."""
        assert self.sync is not None
        cfg = self.plan.config
        view = self.optimizer.export() if averages_optimizer_state(step, self.plan.parallel.sync, cfg.checkpoint.every,
                                                                   cfg.steps) else None
        self.steps_done = None
        return self.sync_replicas(view, live)

    def sync_replicas(self, view: StateView | None, live: tuple[int, ...] | None, *, step: int = 0,
                      whole: bool = True) -> int:
        """local_sgd / diloco / gossip's sync (`ReplicaSync.synchronise`), averaging the inner state of `view` too
        when one is given; the optimizer then takes the parameters it changed (offloaded: into its host copies).
        `step`, `whole`: the sync's step and whether it must leave one model (gossip's rounds do not). The bytes
        sent."""
        self.optimizer.settle()
        assert self.sync is not None
        copies = (self.tied.embedding, self.tied.head)  # a tied embedding's moments: each averaged apart
        apart = {id(t) for r in self.reducers.values() for t, p in r.optimizer_params() if any(p is c for c in copies)}
        inner = _inner_state(view, lambda t: id(t) not in apart) if view is not None else []
        tied = _inner_state(view, lambda t: id(t) in apart) if view is not None else []
        sent = self.sync.synchronise(inner, live, self.coords.dp, state_apart=tied, step=step,
                                     seed=self.plan.config.seed, whole=whole)
        self.optimizer.params_changed()
        return sent

    @torch.no_grad()
    def take_replica_state(self, step: int, source: int, receiving: bool) -> None:
        """After the sync a dropped replica rejoins at: its ranks (`receiving`) take the state after `step` steps
        (parameters, moments, diloco's outer momentum) by broadcast from global rank `source` of their
        data-parallel group; the other live replicas keep their own (they receive into scratch copies)."""
        state = self.checkpoint_state()
        tensors = [local_part(t) for _, t in sorted(state["model"].items())]
        tensors += [local_part(t) for _, v in sorted(state["optim"].items()) for _, t in sorted(v.items())]
        tensors += self.sync.momentum_buffers() if self.sync is not None else []
        for t in tensors:
            dist.broadcast(t if receiving or self.rank == source else t.clone(), src=source, group=self.groups.dp)
        if receiving:
            self._took_state(state, step)
        self._view = None

    def save_checkpoint(self, root: Path, step: int, info: dict, *, background: bool = False,
                        live: tuple[int, ...] | None = None) -> None:
        """Write the state after `step` steps as checkpoint `step` under root (collective). In the background,
        the state is staged first and written by a thread: `finish_checkpoint` (called by the next save, and
        by the caller before the job ends) waits for the write and commits. local_sgd, diloco: a save between
        syncs (a stop, a resize) syncs first, over the `live` replicas when others sit out (`round_of`), which
        then take the lowest live replica's state, as at a rejoin: the checkpoint holds one model."""
        self.finish_checkpoint()
        cfg = self.plan.config
        if self.sync is not None and syncs_before_save(step, self.plan.parallel.sync, cfg.steps):
            self.sync_replicas(None, live)
        if self.sync is not None and live is not None and len(live) < self.plan.dp:
            source = self.plan.rank_of(self.coords.pp, self.coords.tp, min(live))
            self.take_replica_state(step, source, receiving=self.coords.dp not in live)
        state, writer = self.checkpoint_state(), self.rank == 0
        self._view = None  # a load fills and takes it back; a save only reads it (and keeps no copy)
        # local_sgd, diloco: replica 0's inner moments where the replicas' differ (`parallel.sync`)
        lowest = self.sync is not None
        if background:
            finish = checkpoint.start_async_save(state, root, step, info, self.groups.checkpoint, writer, lowest)
            self._pending_checkpoint = (finish, root, step)
        else:
            checkpoint.save(state, root, step, info, self.groups.checkpoint, writer, lowest)
            self._committed(root, step)

    def finish_checkpoint(self) -> None:
        """Wait for a checkpoint being written in the background, and commit it."""
        self.optimizer.settle()  # and the state complete (callers read the parameters after it: the job's end)
        if self._pending_checkpoint is not None:
            finish, root, step = self._pending_checkpoint
            self._pending_checkpoint = None
            finish()
            self._committed(root, step)

    def _committed(self, root: Path, step: int) -> None:
        if self.rank == 0:
            checkpoint.prune(root, self.plan.config.checkpoint.keep, step)

    @torch.no_grad()
    def load_checkpoint(self, directory: Path, step: int) -> None:
        """Take parameters and optimizer state from the checkpoint of `step`, whatever layout wrote it."""
        state, self.steps_done = self.checkpoint_state(), None
        if "sync" in state and not saved_outer_state(directory):
            del state["sync"]  # an allreduce job's checkpoint: diloco's outer momentum starts at zero
        checkpoint.load(state, directory, self.groups.checkpoint)
        self._took_state(state, step)

    def local_state(self, finish_saves: bool = True) -> dict:
        """This rank's parameters and AdamW moments as plain local tensors (not copies), to outlive the trainer
        and its process groups across an in-memory resize or a recovery from a live replica (`adopt_state`).
        `finish_saves=False` after a failure: a background save is left unfinished (its peers may be gone)."""
        if finish_saves:
            self.finish_checkpoint()
        state = self.checkpoint_state()
        self._view = None
        return {"model": {k: local_part(t).detach() for k, t in state["model"].items()},
                "optim": {k: {m: local_part(t) for m, t in v.items()} for k, v in state["optim"].items()}}

    def adopt_state(self, kept: dict | None, step: int, source: int | None) -> None:
        """Take parameters and moments after `step` steps from `kept` (this rank's own, from `local_state` in
        the layout before a resize), then, when `source` is set, from that global rank of this rank's
        data-parallel group (a broadcast, so new ranks get the state of a surviving replica)."""
        state, self.steps_done = self.checkpoint_state(), None
        # ("model", name) or ("optim", name, moment): where each tensor's value is in `kept`
        tensors: list[tuple[tuple[str, ...], torch.Tensor]] = [
            (("model", k), local_part(t)) for k, t in sorted(state["model"].items())]
        tensors += [(("optim", k, m), local_part(t)) for k, v in sorted(state["optim"].items())
                    for m, t in sorted(v.items())]
        with torch.no_grad():
            for key, mine in tensors:
                if kept is not None:
                    mine.copy_(kept["model"][key[1]] if key[0] == "model" else kept["optim"][key[1]][key[2]])
                if source is not None and self.groups.dp is not None:
                    dist.broadcast(mine, src=source, group=self.groups.dp)
        self._took_state(state, step)

    def _took_state(self, state: dict, step: int) -> None:
        """After `checkpoint_state()`'s tensors were filled (from a checkpoint, or in memory by a resize): the
        moments into the optimizer (with ZeRO-1, this rank's slices) and its step counter set to `step`."""
        names = {name: p for p, name in self.tied.state_names(self.chunks).items()}
        moments = {names[name]: m for name, m in state["optim"].items()}
        self.tied.copy_to_head(moments, self._head_moments)  # where the embedding stood for both copies
        assert self._view is not None  # the view checkpoint_state() exported, whose tensors were filled
        for reducer in self.reducers.values():
            reducer.load_moments(self._view.state, moments)
        self._view.write_back()
        self._view = None
        self.optimizer.set_step(step)
        if self.sync is not None:
            self.sync.took_state()
        if self.versions is not None:  # 2bw: the loaded weights are the older version too
            self.versions.took_state()
        self.steps_done = step


def _inner_state(view: StateView, keep: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
    """This rank's optimizer state (its moments, in the checkpoint's form: `view`) of the tensors the optimizer
    updates that `keep` keeps, which a local_sgd or diloco sync a checkpoint follows averages across the
    replicas."""
    return [local_part(t) for tensor, state in view.state.items() if keep(tensor) for t in state.values()]
