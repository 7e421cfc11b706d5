"""`parallel.sync.kind: parameter_server`: the math of one server shard (`ShardState`: its share of the parameters,
their optimizer state under the job's `optimizer.kind`, and how it applies the pushes: BSP's mean once per step,
SSP's and ASP's each push as it arrives) and a replica's side (`ServerClient`, what a job's rank holds: pull the
parameters into the model, push its gradients in one bucket per shard; `Replica`, the same around a loss function
for the tests and the bench), over a `Transport` the actors provide (`actors.ps_shard`: Ray actors and object
refs). The clock (who may start which step) and the staleness rule are `parallel.plan.sync.parameter_server`'s.

Written by hand: torch has no parameter server (its `torch.distributed.rpc` parameter-server example is a tutorial,
and rpc is in maintenance). Torch-free at module level would buy nothing here (only ranks and shards import it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from trainyard.parallel.config import OptimizerConfig
from trainyard.parallel.names import ConsistencyName
from trainyard.parallel.optim.lr_schedules import lr_at
from trainyard.parallel.optim.optimizer import make_optimizer, set_lr
from trainyard.parallel.plan.sync.parameter_server import CONSISTENCIES, push_weight


@dataclass(frozen=True)
class Applied:
    """One update a shard applied: the step it was for, the worker whose push it was (-1: BSP's mean of all), the
    staleness it carried (`parameter_server.staleness_of`) and the shard's update count after it."""

    step: int
    worker: int
    staleness: int
    version: int


@dataclass
class ShardState:
    """One shard: the tensors it owns (its own copies), the job's optimizer over them, and the pushes of steps
    not yet applied (BSP)."""

    tensors: list[torch.Tensor]
    optimizer_cfg: OptimizerConfig
    steps: int
    """The job's steps (the learning-rate schedule's length)."""
    consistency: ConsistencyName
    workers: int
    pending: dict[int, list[list[torch.Tensor]]] = field(default_factory=dict)
    applied: list[Applied] = field(default_factory=list)

    def __post_init__(self) -> None:
        owned = [torch.nn.Parameter(t.detach().clone()) for t in self.tensors]
        self.tensors = list(owned)
        # Weight decay on matrices only, as the trainer's optimizer: (tensor, its parameter) pairs are the same here.
        self.optimizer = make_optimizer([(p, p) for p in owned], self.optimizer_cfg)

    def receive(self, worker: int, step: int, grads: Sequence[torch.Tensor], staleness: int = 0) -> list[Applied]:
        """Take `worker`'s gradients of step `step`; the updates this applied (none while a BSP step waits for
        the other workers' pushes)."""
        if not CONSISTENCIES[self.consistency].applies_mean:
            scale = push_weight(self.consistency, self.workers)
            self._apply(step, [g * scale for g in grads])
            return [self._log(step, worker, staleness)]
        waiting = self.pending.setdefault(step, [])
        waiting.append(list(grads))
        if len(waiting) < self.workers:
            return []
        del self.pending[step]
        # The mean summed in worker order is not rank order; sum in a fixed order: stack, then mean over dim 0.
        self._apply(step, [torch.stack(parts).mean(0) for parts in zip(*waiting, strict=True)])
        return [self._log(step, -1, staleness)]

    def _apply(self, step: int, grads: Sequence[torch.Tensor]) -> None:
        for t, g in zip(self.tensors, grads, strict=True):
            t.grad = g.to(t.dtype).view_as(t)
        set_lr(self.optimizer, lr_at(step, self.optimizer_cfg, self.steps))
        with torch.no_grad():
            self.optimizer.step()
        for t in self.tensors:
            t.grad = None

    def _log(self, step: int, worker: int, staleness: int) -> Applied:
        record = Applied(step, worker, staleness, len(self.applied) + 1)
        self.applied.append(record)
        return record


class Transport(Protocol):
    """How a replica reaches the shards (`actors.ps_shard.RayTransport`)."""

    def pull(self, step: int) -> tuple[list[torch.Tensor], int]:
        """The parameters (in the model's order) once this worker may start `step`, and the staleness they carry."""
        ...

    def push(self, step: int, grads: list[torch.Tensor], staleness: int) -> None:
        """This worker's gradients of `step` (in the model's order), one bucket per shard; need not wait."""
        ...


@dataclass
class ServerClient:
    """A rank's side of the server in a job (`RankTrainer.serve`): its trainable parameters are the server's,
    pulled before each step's compute (at the end of the one before: so evaluation, a checkpoint and the export
    after a step see the server's parameters after it) and pushed as gradients after it."""

    params: list[torch.Tensor]
    transport: Transport
    staleness: int = 0
    """The staleness of the parameters the model holds (`parameter_server.staleness_of`)."""
    wait_s: float = 0.0
    """Seconds the last pull took (the wait for the clock, and the transfer)."""

    def pull(self, step: int) -> None:
        """The server's parameters once this rank may start `step`, into the model."""
        start = time.perf_counter()
        values, self.staleness = self.transport.pull(step)
        with torch.no_grad():
            for p, v in zip(self.params, values, strict=True):
                p.copy_(v)
        self.wait_s = time.perf_counter() - start

    def push(self, step: int) -> None:
        """This rank's gradients of `step` (on the host: the shards are CPU actors), with the staleness of the
        parameters they were computed on."""
        grads = [torch.zeros_like(p, device="cpu") if p.grad is None else p.grad.detach().to("cpu", copy=True)
                 for p in self.params]
        self.transport.push(step, grads, self.staleness)


LossFn = Callable[[torch.nn.Module, int], torch.Tensor]
"""(the model, the step) -> this replica's loss: the mean over its share of the step's batch (equal shares, so
the replicas' mean gradient, BSP's update, is the whole batch's, as all-reduce's sum of globally scaled ones)."""


@dataclass
class Replica:
    """One worker of a parameter server: a model whose parameters are the server's, stepped by pull, compute,
    push. `before_step` lets a fault drill (`slow_rank`) stretch a step."""

    model: torch.nn.Module
    transport: Transport
    loss_fn: LossFn
    before_step: Callable[[int, float], None] | None = None
    paces: list[float] = field(default_factory=list)
    """Seconds of each step (pull to push)."""
    losses: list[float] = field(default_factory=list)
    stalenesses: list[int] = field(default_factory=list)

    def run(self, first: int, steps: int) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for step in range(first, steps):
            start = time.perf_counter()
            values, staleness = self.transport.pull(step)
            with torch.no_grad():
                for p, v in zip(params, values, strict=True):
                    p.copy_(v)
            for p in params:
                p.grad = None
            loss = self.loss_fn(self.model, step)
            loss.backward()
            if self.before_step is not None:
                self.before_step(step, time.perf_counter() - start)
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
            self.transport.push(step, grads, staleness)
            self.paces.append(time.perf_counter() - start)
            self.losses.append(loss.item())
            self.stalenesses.append(staleness)
