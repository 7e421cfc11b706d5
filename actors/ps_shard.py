"""Parameter-server shards as Ray actors (`parallel.sync.kind: parameter_server`), named `trainyard/<job>/ps<i>`,
CPU-only and placed apart from the ranks (no bundle of the job's placement group: `ps_shards` from tensors,
`shards_of` from buckets a job's rank 0 hands over as object refs, `WorkerGroup.start_shards`); and the replica's
`RayTransport`, which pulls the parameters from every shard at once (object refs, fetched together) and pushes a
bucket of gradients to each without waiting (the refs are collected at the next pull, so the push overlaps the
wait for the clock).

A shard is an async actor: `pull(worker, step)` waits on the shard's clock (`parallel.plan.sync.parameter_server
.may_start`) and `push` may complete a BSP step, which wakes the waiters. The math is
`parallel.runtime.sync.parameter_server.ShardState`'s. Each shard sees every worker's push of every step, so each
keeps the whole clock, and a pull that waits on every shard waits on the global rule. torch is imported in the
shard's process only: the coordinator creates the shards and never imports it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

import ray
from trainyard.actors.naming import NAMESPACE, ps_shard_name
from trainyard.parallel.config import OptimizerConfig, SyncConfig
from trainyard.parallel.plan.sync.parameter_server import assign_shards, may_start, staleness_of

if TYPE_CHECKING:  # torch is imported in the shard's process, not in the coordinator's (which creates them)
    import torch


@ray.remote(num_cpus=0)
class ParameterShard:
    """One shard: its tensors and optimizer (`ShardState`), the workers' clocks (steps finished each) and the
    paces and staleness of every applied update (`metrics`)."""

    def __init__(self, tensors: list[torch.Tensor], optimizer_cfg: OptimizerConfig, sync: SyncConfig, workers: int,
                 steps: int, first: int = 0):
        """`first`: the step the job goes on from (every worker has finished the steps before it)."""
        import torch
        from trainyard.parallel.runtime.sync.parameter_server import ShardState

        torch.set_num_threads(1)
        self.sync = sync
        self.state = ShardState(tensors, optimizer_cfg, steps, sync.consistency, workers)
        self.finished = [first] * workers
        self.changed = asyncio.Condition()

    async def pull(self, worker: int, step: int) -> tuple[list[torch.Tensor], int]:
        """This shard's tensors once `worker` may start `step`, and the staleness they carry."""
        async with self.changed:
            await self.changed.wait_for(lambda: may_start(step, self.finished, self.sync.consistency,
                                                          self.sync.staleness))
            return [t.detach().clone() for t in self.state.tensors], staleness_of(step, self.finished)

    async def push(self, worker: int, step: int, grads: list[torch.Tensor], staleness: int) -> int:
        """`worker`'s gradients of `step` for this shard's tensors; the updates applied so far."""
        async with self.changed:
            done = self.state.receive(worker, step, grads, staleness)
            if self.state.pending.get(step) is None:  # applied (alone, or as the last of a BSP step)
                if done and done[-1].worker == -1:
                    self.finished = [max(f, step + 1) for f in self.finished]
                else:
                    self.finished[worker] = step + 1
            self.changed.notify_all()
            return len(self.state.applied)

    def tensors(self) -> list[torch.Tensor]:
        return [t.detach() for t in self.state.tensors]

    def metrics(self) -> list[dict]:
        """Every applied update: its step, its worker (-1: BSP's mean), the staleness it carried, the version."""
        return [asdict(a) for a in self.state.applied]


def ps_shards(job_id: str, params: list[torch.Tensor], optimizer_cfg: OptimizerConfig, sync: SyncConfig,
              workers: int, steps: int) -> tuple[list[ray.actor.ActorHandle], list[int]]:
    """The job's shards, each owning its share of `params` (`assign_shards`), and the owner of each parameter. They
    take no CPU slot of the ranks' placement group (Ray schedules them outside it, on any node's CPUs)."""
    owner = assign_shards([p.numel() for p in params], sync.shards)
    buckets = [[p for p, o in zip(params, owner, strict=True) if o == s] for s in range(sync.shards)]
    return shards_of(job_id, buckets, optimizer_cfg, sync, workers, steps), owner


def shards_of(job_id: str, buckets: Sequence[list[torch.Tensor] | ray.ObjectRef], optimizer_cfg: OptimizerConfig,
              sync: SyncConfig, workers: int, steps: int, first: int = 0) -> list[ray.actor.ActorHandle]:
    """A shard for each of `buckets` (its tensors, or an object ref to them: a job's come from its rank 0, and
    never pass through the coordinator), the job's steps from `first` on to run."""
    return [ParameterShard.options(name=ps_shard_name(job_id, s), namespace=NAMESPACE).remote(  # type: ignore[attr-defined]
        bucket, optimizer_cfg, sync, workers, steps, first) for s, bucket in enumerate(buckets)]


class RayTransport:
    """A replica's way to the shards (`parallel.runtime.sync.parameter_server.Transport`)."""

    def __init__(self, shards: list[ray.actor.ActorHandle], owner: list[int], worker: int):
        self.shards, self.owner, self.worker = shards, owner, worker
        self.in_flight: list[ray.ObjectRef] = []

    def pull(self, step: int) -> tuple[list[torch.Tensor], int]:
        ray.get(self.in_flight)  # a push's failure surfaces here
        self.in_flight = []
        answers = ray.get([s.pull.remote(self.worker, step) for s in self.shards])
        parts = [iter(tensors) for tensors, _ in answers]
        return [next(parts[o]) for o in self.owner], max(staleness for _, staleness in answers)

    def push(self, step: int, grads: list[torch.Tensor], staleness: int) -> None:
        for s, shard in enumerate(self.shards):
            bucket = [g for g, o in zip(grads, self.owner, strict=True) if o == s]
            self.in_flight.append(shard.push.remote(self.worker, step, bucket, staleness))

    def close(self) -> None:
        ray.get(self.in_flight)
        self.in_flight = []
