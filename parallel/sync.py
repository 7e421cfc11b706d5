"""How data-parallel replicas keep in step (`parallel.sync`), a replica being a whole pp x tp group.

- `allreduce` (the default): the gradient reducer (`parallel.data_parallel`) sums every gradient across the
  replicas every step; nothing here runs.
- `local_sgd` (Stich 2019, Lin et al. 2020): each replica steps on its own share of the step's global batch
  (the layout-independent sampler's, as always), with no traffic between replicas; every `every` steps (and
  after the last) the replicas' parameters are averaged.
- `diloco` (Douillard et al. 2023): as local_sgd, but at a sync the averaged change since the last sync, the
  pseudo-gradient `anchor - mean(params)`, is the gradient of an outer SGD with Nesterov momentum over the
  anchor (the parameters of the last sync); every replica then starts again from the new anchor.

So the link between replicas carries the parameters once per `every` steps instead of the gradients every step.
Each replica's inner optimizer state stays its own, except at the syncs a checkpoint follows: there the
replicas also average it, so the checkpoint (which holds one copy of what the replicas share) is the whole
state, and a resumed run follows the uninterrupted one exactly (both average at those steps).

Written by hand: torch has no local SGD. torchft has LocalSGD and DiLoCo, but as wrappers over its own
fault-tolerant manager (lighthouse, quorum, its process groups); the math here is torchft's: the outer
optimizer is torch's own SGD (nesterov) over the anchor, its `.grad` the pseudo-gradient. The pure rules (when
to sync, the bytes it sends) come first; `ReplicaSync` runs the collective on a rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.parallel.config import SyncConfig

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from trainyard.parallel.plan import Plan

FP32 = 4
LOCAL_KINDS = ("local_sgd", "diloco")
"""The kinds whose replicas step apart between synchronisations."""


def is_local(cfg: SyncConfig) -> bool:
    return cfg.kind in LOCAL_KINDS


def syncs_after(step: int, cfg: SyncConfig, steps: int) -> bool:
    """Whether the replicas synchronise their parameters after step `step` (0-based): every `every` steps, and
    after the job's last step (so the final state, and every checkpoint, is one model)."""
    return is_local(cfg) and ((step + 1) % cfg.every == 0 or step + 1 == steps)


def averages_optimizer_state(step: int, cfg: SyncConfig, checkpoint_every: int, steps: int) -> bool:
    """Whether the sync after `step` also averages the replicas' inner optimizer state: a checkpoint follows it
    (every `checkpoint_every` steps, and the final one)."""
    done = step + 1
    return syncs_after(step, cfg, steps) and (done == steps or (checkpoint_every > 0 and done % checkpoint_every == 0))


def cross_replica_bytes(cfg: SyncConfig, local_params: int, dp: int, wire_bytes: int = FP32) -> float:
    """Bytes one rank puts into its all-reduces across the replicas per step, on average (the payload; a ring
    all-reduce sends about twice that over the wire). allreduce: every local gradient, at the wire type
    (`parallel.reduce_dtype`), each step; local_sgd and diloco: every local parameter (fp32) once per `every`
    steps. 0 with one replica."""
    if dp == 1:
        return 0.0
    if is_local(cfg):
        return FP32 * local_params / cfg.every
    return float(wire_bytes * local_params)


def saved_outer_state(directory: Path) -> bool:
    """Whether the checkpoint in `directory` holds diloco's outer momentum (one of an allreduce job does not: a
    diloco job resumed from it starts its momentum at zero)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return any(key.startswith("sync.") for key in keys)


def replica_group(plan: Plan) -> dist.ProcessGroup | None:
    """This rank's data-parallel replica (its whole pp x tp group) as a process group, every rank creating every
    replica's; None when a replica is one rank. A local_sgd or diloco replica clips its gradients' norm over it."""
    import torch.distributed as dist

    replicas = [[plan.rank_of(p, t, d) for p in range(plan.pp) for t in range(plan.tp)] for d in range(plan.dp)]
    if len(replicas[0]) == 1:
        return None
    mine, _ = dist.new_subgroups_by_enumeration(replicas)
    return mine


class ReplicaSync:
    """One rank's part of the synchronisations of a local_sgd or diloco job: `params` are this rank's parameters
    (DTensors with tp; the math runs on their local shards), `group` the data-parallel group of its (pp, tp)
    shard."""

    def __init__(self, cfg: SyncConfig, params: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int):
        import torch
        from torch.distributed.tensor import DTensor

        self.cfg, self.group, self.dp, self.layouts = cfg, group, dp, params
        self.params = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None
        if cfg.kind == "diloco":
            self.anchor = [p.detach().clone() for p in params]
            momentum = cfg.outer_momentum
            self.outer = torch.optim.SGD(self.anchor, lr=cfg.outer_lr, momentum=momentum, nesterov=momentum > 0)

    def bytes_per_sync(self) -> int:
        return FP32 * sum(p.numel() for p in self.params)

    def synchronise(self, optimizer_state: list[torch.Tensor] = ()) -> int:
        """Average the parameters over the replicas (diloco: then the outer step, and every replica takes the new
        anchor), and the tensors of `optimizer_state` in place; the bytes this rank all-reduced."""
        import torch
        import torch.distributed as dist

        with torch.no_grad():
            if optimizer_state and self.group is not None:
                state = torch.cat([t.reshape(-1) for t in optimizer_state])
                dist.all_reduce(state, group=self.group)
                state /= self.dp
                for t, mean in zip(optimizer_state, torch.split(state, [t.numel() for t in optimizer_state]),
                                   strict=True):
                    t.copy_(mean.view_as(t))
            flat = torch.cat([p.reshape(-1) for p in self.params])
            if self.group is not None:
                dist.all_reduce(flat, group=self.group)
                flat /= self.dp
            mean = torch.split(flat, [p.numel() for p in self.params])
            if self.outer is None:
                for p, m in zip(self.params, mean, strict=True):
                    p.copy_(m.view_as(p))
            else:
                for a, m in zip(self.anchor, mean, strict=True):
                    a.grad = a - m.view_as(a)  # the pseudo-gradient
                self.outer.step()
                for p, a in zip(self.params, self.anchor, strict=True):
                    p.copy_(a)
        return self.bytes_per_sync() + FP32 * sum(t.numel() for t in optimizer_state)

    def took_state(self) -> None:
        """The parameters were replaced (a checkpoint, always taken at a sync, or a replica's state): they are
        the anchor."""
        import torch

        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                a.copy_(p)

    def outer_state(self) -> list[torch.Tensor]:
        """The outer optimizer's momentum buffers, one per parameter and laid out like it (a DTensor with tp, so
        a checkpoint stores each shard once), for a checkpoint (diloco with momentum; created at zero, as SGD's
        first step would)."""
        import torch
        from torch.distributed.tensor import DTensor

        if self.outer is None or self.cfg.outer_momentum == 0:
            return []
        for a in self.anchor:
            state = self.outer.state[a]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(a)
        return [DTensor.from_local(self.outer.state[a]["momentum_buffer"], p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride(), run_check=False) if isinstance(p, DTensor)
                else self.outer.state[a]["momentum_buffer"] for a, p in zip(self.anchor, self.layouts, strict=True)]
