"""One rank's training state and step: its model chunks, optimizer and data, and `train_step`.

This is everything a worker does, expressed with torch.distributed alone (no Ray), so it runs under
spawned processes in tests and under Ray actors in the service. A step: run this rank's pipeline actions
(forward and backward of each micro-batch through its chunks, activations exchanged with neighbouring
stages; with pp = 1 this is plain gradient accumulation; the tensor-parallel collectives run inside the
layers), sum gradients across data-parallel replicas, clip the global norm (summed across tp shards and the
pipeline), set the learning rate and take an AdamW step. With `parallel.sync` local_sgd or diloco the replicas
step apart instead (no gradient sum across them; each steps on its own share's mean gradient and clips its own
norm), and `parallel.runtime.sync.ReplicaSync` averages their parameters every H steps. With a parameter server a
replica (one rank) computes its own share's mean gradient too, but pushes it to the server's shards and pulls the
parameters back in place of the optimizer step (`serve`, `parallel.runtime.sync.parameter_server.ServerClient`).

The loss of every micro-batch is divided by the global batch's count of targets that count (all of its
tokens; with a loss mask, the assistant/completion ones: `parallel.data.datasets.step_counted_targets`, worked out on
every rank from the step's sample ids) before backward, so summed gradients equal the gradient of the
global mean loss whatever the layout.

Host reads. Nothing in a step waits for the device: the loss, the clipped gradient norm (`clip_grad_norm` scales by
min(1, max / norm) on the device), the token counts (from the sample ids, on the host) and the MoE statistics stay
device tensors, and `queue_step` ends with all of them stacked into one tensor on its way to the host
(`parallel.runtime.step.step_figures`). `read_step` reads it (`.tolist()`, the step's one read) and the divergence check
(`DivergedError`, naming that step) acts on it. The rank reads a step's figures one step late, once the next
step's work is queued behind them (`RankDriver.queue_step`), so on a GPU the device goes from one step's kernels
straight into the next one's; `train_step` reads them at once, for callers that compare trainers step by step.
The MoE layers' dispatch is the exception, one read per layer and micro-batch when dropless, none with a capacity
(`parallel.models.components.moe`). tests/unit/test_host_reads.py counts them.

How a rank is built (its chunks on the meta device, tensor parallelism, LoRA, recompute, compile, FSDP2, their
values, the tied embeddings, the gradient reducers and the optimizer) is `parallel.runtime.build`'s `build_rank`, in
one fixed order written and explained there. The state that moves (the checkpoint's form of it, saves and loads, a
resize's or a rejoining replica's state, local_sgd / diloco's averaging) is `parallel.runtime.rank_state`'s
`RankState`, which the trainer holds and delegates to; what is left here is how the strategies (sharding,
compression, sync, split backward, offload) are wired for a step, and the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from trainyard.parallel.data.datasets import Dataset, counted_targets, open_dataset
from trainyard.parallel.data.sampler import rank_share, validation_batches
from trainyard.parallel.models.components.documents import Documents
from trainyard.parallel.models.components.moe import moe_layers
from trainyard.parallel.optim.lr_schedules import lr_at
from trainyard.parallel.optim.optimizer import clip_grad_norm, set_lr
from trainyard.parallel.plan import Plan
from trainyard.parallel.plan.schedule.actions import FREEING_KINDS, Action, ActionKind, stage_location
from trainyard.parallel.plan.sync.replica_sync import averages_optimizer_state, syncs_after, whole_sync
from trainyard.parallel.runtime.build import build_rank
from trainyard.parallel.runtime.compile import compile_seconds
from trainyard.parallel.runtime.cp.split import ContextSplit
from trainyard.parallel.runtime.distributed import RankGroups
from trainyard.parallel.runtime.pipeline.pipeline import Batch, PipelineExecutor, PipelineTimings
from trainyard.parallel.runtime.pipeline.weight_versions import WeightVersions
from trainyard.parallel.runtime.rank_state import RankState
from trainyard.parallel.runtime.step.step_figures import Figures, stage
from trainyard.parallel.runtime.step.step_inputs import autocast_context, lazy_batches, lazy_documents, loss_scale
from trainyard.parallel.runtime.step.step_stats import DivergedError, StepStats
from trainyard.parallel.runtime.sync import make_replica_sync, replica_group
from trainyard.parallel.runtime.sync.parameter_server import ServerClient, Transport
from trainyard.parallel.runtime.tp.tensor_parallel import activation_shape, loss_context

FORWARD_KINDS = (ActionKind.FORWARD, ActionKind.SEND_ACT, ActionKind.RECV_ACT)
"""A pipeline schedule's actions that evaluation runs: forwards and the activations between stages."""
METER_EVERY = 50
"""Steps between two runs of the saved-tensor meter (`PipelineExecutor.run`'s `meter`): a Python hook on every tensor
autograd saves, 0.8 ms of the dp bench's 42 ms forward on CPU; the steps between report the last metered peak."""


class RankTrainer:
    def __init__(self, plan: Plan, rank: int, groups: RankGroups, device: torch.device):
        cfg = plan.config
        self.plan, self.rank, self.groups, self.device = plan, rank, groups, device
        self.coords = plan.coords(rank)
        # The chunks, their sharding and values, the reducers and the optimizer, in `parallel.runtime.build`'s
        # order: on the meta device, sharded there (tp, ep, ZeRO-2/3), then only this rank's shards materialized.
        built = build_rank(plan, rank, groups, device)
        self.chunks, self.sharded, self.tied = built.chunks, built.sharded, built.tied
        self.reducers, self.compressor, self.optimizer = built.reducers, built.compressor, built.optimizer
        self.moe_layers = [layer for chunk in self.chunks for layer in moe_layers(chunk)]
        par = plan.parallel
        # local_sgd, diloco: each replica steps alone; its parameters are averaged at the syncs (`self.sync`).
        # A replica is `plan.reduce_dp` dp ranks (`parallel.sync.replicas`), which reduce, shard and spread experts
        # among themselves as allreduce's dp ranks do.
        # A parameter server's replicas (one dp rank each) step on their own share's mean gradient too, pushed to
        # the shards instead of stepped here (`serve`).
        self.local_sync = (plan.sync.steps_apart or plan.sync.server) and plan.dp > plan.reduce_dp
        self.norm_group = replica_group(plan) if self.local_sync else dist.group.WORLD if plan.world_size > 1 else None
        self._norm_is_local: bool | None = None
        """Whether the gradient norm needs no collective (`_norm_inputs`); decided at the first step."""
        self.steps_run = 0
        """Steps this trainer ran; the saved-tensor meter runs on every METER_EVERY-th, the first included."""
        params: list[torch.Tensor] = [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]
        tied = frozenset(i for i, p in enumerate(params) if p is self.tied.embedding or p is self.tied.head)
        self.sync = make_replica_sync(par.sync, params, groups.replicas, plan.dp // plan.reduce_dp, apart=tied) \
            if self.local_sync else None
        self.server: ServerClient | None = None
        """parameter_server: the shards this rank pulls its parameters from and pushes its gradients to (`serve`)."""
        self.rank_state = RankState(plan, rank, groups, self.chunks, self.reducers, self.optimizer, self.sync,
                                    self.tied)
        # 2bw: each step computes on the weights one version old and steps the newest (PipeDream-2BW)
        self.versions = WeightVersions(params) if plan.schedule.delays_update else None
        self.rank_state.versions = self.versions
        # Where each chunk's gradients become final: its last backward (or weight-gradient half) in the schedule.
        self.last_backward = {a.chunk: a.microbatch for a in plan.actions[self.coords.pp]
                              if a.kind in FREEING_KINDS}
        self.dataset = open_dataset(cfg)
        self.val_dataset = open_dataset(cfg, "val") if cfg.eval.every > 0 else None
        self.forward_actions = [a for a in plan.actions[self.coords.pp] if a.kind in FORWARD_KINDS]
        self.cp_split = ContextSplit(groups.cp, groups.cp_ranks or [rank], self.coords.cp, cfg.model.seq_len, device) \
            if plan.cp > 1 else None
        """Context parallelism: the tokens of each sequence this rank keeps (`parallel.runtime.cp.split`)."""
        tokens_per_step = cfg.global_batch * cfg.model.seq_len
        self.actions = list(plan.actions[self.coords.pp])
        self.executor = PipelineExecutor(
            self.chunks, self.coords.pp, plan.pp, groups.pp_ranks, activation_shape=activation_shape(plan),
            device=device, loss_scale=1.0 / tokens_per_step, loss_context=loss_context(plan),
            autocast=autocast_context(cfg.precision, device),
            before_backward=self._arm_reduction if par.overlap_reduce or self.sharded else None,
            sharded=self.sharded, placement=plan.placement,
        )

    @property
    def is_last_stage(self) -> bool:
        last = self.plan.n_virtual_stages - 1  # with the V placement (zbv) that is on pp rank 0
        return stage_location(last, self.plan.pp, self.plan.placement)[0] == self.coords.pp

    def train_step(self, step: int, microbatch_ids: list[list[int]], live: tuple[int, ...] | None = None
                   ) -> StepStats:
        """One step, its figures read at once (`queue_step` then `read_step`): for callers that step one trainer
        against another (benches, tests). The service's ranks read them one step late (`RankDriver.queue_step`)."""
        return self.read_step(self.queue_step(step, microbatch_ids, live))

    def queue_step(self, step: int, microbatch_ids: list[list[int]], live: tuple[int, ...] | None = None
                   ) -> Figures:
        """One step's work, queued, its figures left on their way to the host (`read_step` reads them); `live`: the
        replicas in the round when some are dropped (`replica_sync.round_of`): the sync averages over them."""
        compiling = self.plan.config.compile
        start, compiled_before = time.perf_counter(), compile_seconds() if compiling else 0.0
        if self.compressor is not None:
            self.compressor.step = step
        for reducer in self.reducers.values():
            reducer.zero_grad()
        for _, layer in self.moe_layers:
            layer.stats.zero_()
        self.executor.loss_scale = self._loss_scale(step, microbatch_ids)
        with self.versions.previous() if self.versions is not None else nullcontext():
            loss_sum, timings = self._forward_backward(microbatch_ids, meter=self.steps_run % METER_EVERY == 0)
        self.steps_run += 1
        for reducer in self.reducers.values():
            reducer.finish()
        if self.tied.active:
            self.tied.sum_grads(pair for reducer in self.reducers.values() for pair in reducer.held_grads())
        self.optimizer.settle()  # offload overlapped: the last step's host steps the forward did not wait for
        weighted, norm_group = self._norm_inputs()
        norm = clip_grad_norm(weighted, self.plan.config.optimizer.grad_clip, norm_group)
        lr = lr_at(step, self.plan.config.optimizer, self.plan.config.steps)
        set_lr(self.optimizer, lr)
        self.rank_state.steps_done = None
        if self.server is None:
            self.optimizer.step()
            server_figures = {}
        else:  # parameter_server: the shards step the parameters
            server_figures = self._push_and_pull(step)
        for reducer in self.reducers.values():
            reducer.gather_params()
        if self.versions is not None:
            self.versions.stepped()
        # Across the replicas: the dense gradients' reduction every step (what it handed to its collectives), or
        # local_sgd / diloco / gossip's syncs.
        sent = 0 if self.local_sync or "dense" not in self.reducers else self.reducers["dense"].wire_bytes
        cfg = self.plan.config
        if self.sync is not None and syncs_after(step, self.plan.parallel.sync, cfg.steps):
            self.optimizer.settle()  # the sync reads the parameters
            checkpointed = averages_optimizer_state(step, self.plan.parallel.sync, cfg.checkpoint.every, cfg.steps)
            view = self.optimizer.export() if checkpointed else None
            whole = whole_sync(step, self.plan.parallel.sync, cfg.checkpoint.every, cfg.steps)
            sent = self.rank_state.sync_replicas(view, live, step=step, whole=whole)
            if view is not None:
                view.write_back()
        self.rank_state.steps_done = step + 1
        step_loss = self._step_loss(loss_sum)
        # The loss, the norm and the MoE statistics in one tensor, sent on to the host without waiting (module
        # doc, "Host reads"): `read_step` reads them.
        parts = [norm.reshape(1).double(), self._moe_stats_tensor().flatten()]
        values, ready = stage(torch.cat(parts if step_loss is None else [step_loss.reshape(1).double(), *parts]))
        device_bytes, host_bytes = self.optimizer.state_bytes()
        host = dict(compute_s=time.perf_counter() - start, pp_rank=self.coords.pp, dp_rank=self.coords.dp,
                    tp_rank=self.coords.tp, optimizer_bytes=device_bytes, optimizer_host_bytes=host_bytes,
                    early_reductions=sum(r.started_early for r in self.reducers.values()),
                    buckets=sum(len(r.buckets) for r in self.reducers.values()),
                    reduce_bytes=sum(r.wire_bytes for r in self.reducers.values()),
                    compile_s=compile_seconds() - compiled_before if compiling else 0.0, cross_replica_bytes=sent,
                    **server_figures)
        return Figures(step, values, ready, step_loss is not None, lr, timings, self.executor.clock.detach(), host)

    def read_step(self, queued: Figures) -> StepStats:
        """A queued step's figures, read to the host (the step's one read), as its `StepStats`; a loss or gradient
        norm that is not finite raises `DivergedError`, naming that step."""
        loss, grad_norm, moe = queued.read()
        self.executor.clock.settle(queued.timings, queued.spans)  # the step's CUDA events are complete now
        if not math.isfinite(grad_norm) or (loss is not None and not math.isfinite(loss)):
            self.rank_state.steps_done = None  # the step applied non-finite gradients: no recovery takes this state
            clip = "" if self.plan.config.optimizer.grad_clip > 0 else ", or turn optimizer.grad_clip on"
            raise DivergedError(f"step {queued.step}: training diverged: loss {loss}, gradient norm {grad_norm} (not "
                                f"finite) at lr {queued.lr:.6g}; lower optimizer.lr{clip}")
        return StepStats(step=queued.step, loss=loss, grad_norm=grad_norm, lr=queued.lr, moe=self._moe_stats(moe),
                         **queued.host, **asdict(queued.timings))

    def server_params(self) -> list[torch.Tensor]:
        """parameter_server: the parameters the shards own, in the order they take them (the trainable ones)."""
        return [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]

    def serve(self, transport: Transport, step: int) -> None:
        """parameter_server: from now on this rank's parameters are the server's (`transport`'s shards), pulled for
        `step`, the next it runs; its own optimizer is left unused (the shards step theirs)."""
        self.server = ServerClient(self.server_params(), transport)
        self.server.pull(step)

    def _push_and_pull(self, step: int) -> dict:
        """parameter_server: the step's gradients pushed, the parameters for the next step pulled (waiting for the
        clock); the figures the step reports of it: the staleness its parameters carried, the pull's wait."""
        assert self.server is not None
        staleness = self.server.staleness
        self.server.push(step)
        self.server.pull(step + 1)
        return {"ps_staleness": staleness, "ps_wait_s": self.server.wait_s}

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean token loss on the validation batches (forward only, through the pipeline); the last stage's
        ranks return it, the others None."""
        assert self.val_dataset is not None
        cfg = self.plan.config
        total = torch.zeros((), device=self.device)
        batches = validation_batches(cfg, self.val_dataset.num_samples)
        # One mean over every counted target of every batch (a batch with few counted targets weighs little)
        self.executor.loss_scale = 1.0 / max(1, sum(counted_targets(self.val_dataset, ids) for ids in batches))
        for ids in batches:
            share = rank_share(ids, self.coords.dp, self.plan.dp, self.plan.microbatches)
            total += self.executor.run(self.forward_actions, *self._inputs(self.val_dataset, share))[0]
        if self.sharded is not None:  # ZeRO-2 keeps what a forward gathered: free it, the step updates shards
            self.sharded.reshard()
        if not self.is_last_stage:
            value = None
        else:
            if self.groups.dp is not None:
                dist.all_reduce(total, group=self.groups.dp)
            value = float(total)
        self.executor.clock.settle(PipelineTimings())  # evaluation's timings are not reported: its events dropped
        return value

    @property
    def steps_done(self) -> int | None:
        """The steps the parameters and moments hold (None while they are replaced or stepped): `RankState`'s."""
        self.optimizer.settle()
        return self.rank_state.steps_done

    # The state that moves (checkpoints, replicas, resizes) is `parallel.runtime.rank_state`'s: the callers (the
    # driver, the worker actor, tests and benches) keep calling the trainer.
    def checkpoint_state(self) -> dict:
        return self.rank_state.checkpoint_state()

    def sit_in_sync(self, step: int, live: tuple[int, ...]) -> int:
        return self.rank_state.sit_in_sync(step, live)

    def take_replica_state(self, step: int, source: int, receiving: bool) -> None:
        self.rank_state.take_replica_state(step, source, receiving)

    def save_checkpoint(self, root: Path, step: int, info: dict, *, background: bool = False,
                        live: tuple[int, ...] | None = None) -> None:
        self.rank_state.save_checkpoint(root, step, info, background=background, live=live)

    def finish_checkpoint(self) -> None:
        self.rank_state.finish_checkpoint()

    def load_checkpoint(self, directory: Path, step: int) -> None:
        self.rank_state.load_checkpoint(directory, step)

    def local_state(self, finish_saves: bool = True) -> dict:
        return self.rank_state.local_state(finish_saves)

    def adopt_state(self, kept: dict | None, step: int, source: int | None) -> None:
        self.rank_state.adopt_state(kept, step, source)

    def _arm_reduction(self, action: Action) -> None:
        """Before a chunk's last backward (B or W) of the step: its gradients' reduction may start during it."""
        if self.last_backward[action.chunk] == action.microbatch:
            for reducer in self.reducers.values():
                reducer.arm(action.chunk)

    def _norm_inputs(self) -> tuple[list[tuple[torch.Tensor, float]], dist.ProcessGroup | None]:
        """The weighted gradients and the group their norm adds over. Where every rank of the group holds every
        reduced gradient whole (plain data parallelism: no tp, pp, ZeRO or expert parallelism), the norm is this
        rank's own, with weight 1 and no collective (the group's sum of 1/N-weighted copies is that norm)."""
        weighted = self._weighted_grads()
        if self._norm_is_local is None:
            size = dist.get_world_size(self.norm_group) if self.norm_group is not None else 1
            self._norm_is_local = size == 1 or all(w == 1 / size for _, w in weighted)
        if self._norm_is_local:
            return [(g, 1.0) for g, _ in weighted], None
        return weighted, self.norm_group

    def _weighted_grads(self) -> list[tuple[torch.Tensor, float]]:
        """Every gradient this rank holds, weighted by 1 / the ranks holding the same one (see clip_grad_norm):
        the reduction group's ranks all hold it unless ZeRO-1 split it, and a dense parameter replicated over
        tp is also held by every tp rank (routers and experts are reduced over tp already)."""
        tp = self.plan.tp
        weighted = []  # a tied embedding's head copy weighs 0: its gradient is the embedding's (`TiedEmbeddings`)
        for kind, reducer in self.reducers.items():
            replicas = reducer.holders
            for grad, p in reducer.held_grads():
                copies = replicas * (reducer.tp_copies(p, tp) if kind == "dense" else 1)
                weighted.append((grad, self.tied.norm_weight(p) / copies))
        return weighted

    def _step_loss(self, loss_sum: torch.Tensor) -> torch.Tensor | None:
        """The step's loss on the device, on the last stage's ranks (None elsewhere): summed over dp. local_sgd,
        diloco: each replica's loss is its own share's mean (the coordinator averages them), so that nothing crosses
        the replicas between syncs and a replica can fail alone."""
        if not self.is_last_stage:
            return None
        if self.groups.reduce is not None:  # over the replica (local_sgd, diloco), whose loss is its own
            dist.all_reduce(loss_sum, group=self.groups.reduce)
        return loss_sum

    def _moe_stats_tensor(self) -> torch.Tensor:
        """This step's MoE statistics of each block of the stage, summed over the stage's ranks, on the device
        (one row per block; empty for a dense model)."""
        if not self.moe_layers:
            return torch.zeros((0,), dtype=torch.float64, device=self.device)
        stats = torch.stack([layer.stats for _, layer in self.moe_layers])
        if self.groups.stage is not None:
            dist.all_reduce(stats, group=self.groups.stage)
        return stats

    def _moe_stats(self, figures: list[float]) -> dict[str, dict]:
        """The MoE statistics as metrics, from the step's figures read to the host (`_moe_stats_tensor`'s rows)."""
        sequences = self.plan.config.global_batch
        width = len(figures) // max(1, len(self.moe_layers))
        return {block: layer.summarize(figures[i * width:(i + 1) * width], sequences)
                for i, (block, layer) in enumerate(self.moe_layers)}

    def _loss_scale(self, step: int, microbatch_ids: list[list[int]]) -> float:
        return loss_scale(self.plan, self.coords.dp, self.dataset, self.local_sync, step, microbatch_ids)

    def _forward_backward(self, microbatch_ids: list[list[int]], meter: bool = True
                          ) -> tuple[torch.Tensor, PipelineTimings]:
        return self.executor.run(self.actions, *self._inputs(self.dataset, microbatch_ids), meter=meter)

    def _inputs(self, dataset: Dataset, microbatch_ids: list[list[int]]
                ) -> tuple[Callable[[int], Batch], Callable[[int], Documents] | None]:
        """The executor's `batch(mb)` and `documents(mb)`: with context parallelism, this rank's share of them."""
        batch, documents = lazy_batches(dataset, microbatch_ids), lazy_documents(dataset, microbatch_ids, self.device)
        if self.cp_split is None:
            return batch, documents
        return self.cp_split.batches(batch), self.cp_split.documents(batch, documents)
