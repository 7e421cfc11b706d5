"""How data-parallel replicas keep in step (`parallel.sync`), a replica being a whole pp x tp group of one or
(`parallel.sync.replicas`) several dp ranks, which share ZeRO's shards and MoE's experts.

- `allreduce` (the default): the gradient reducer (`parallel.runtime.data_parallel`) sums every gradient across the
  replicas every step; nothing here runs.
- `local_sgd` (Stich 2019, Lin et al. 2020): each replica steps on its own share of the step's global batch
  (the layout-independent sampler's, as always), with no traffic between replicas; every `every` steps (and
  after the last) the replicas' parameters are averaged.
- `diloco` (Douillard et al. 2023): as local_sgd, but at a sync the averaged change since the last sync, the
  pseudo-gradient `anchor - mean(params)`, is the gradient of an outer SGD with Nesterov momentum over the
  anchor (the parameters of the last sync); every replica then starts again from the new anchor.

So the link between replicas carries the parameters once per `every` steps instead of the gradients every step.
Each replica's inner optimizer state stays its own, except at the syncs a `checkpoint.every` checkpoint follows:
there the replicas also average it, so the checkpoint (which holds one copy of what the replicas share) is the
whole state, and a resumed run follows the uninterrupted one exactly (both average at those steps). The job's
last checkpoint (after its last step, or a stop or resize between syncs, which syncs the parameters first:
`syncs_before_save`) continues no run exactly (a longer job has another learning-rate schedule), so it spends
no bytes on the moments: it holds data-parallel replica 0's (`checkpoint.save(from_lowest_rank=True)`), as a
torchft replica that heals takes a live peer's.

Replicas that fail alone (local_sgd, diloco): between syncs no replica waits on another, so when a rank dies
its replica (its whole pp x tp group) is dropped from the round and the others go on stepping. The design,
smaller than torchft's (whose Manager reconfigures its process groups for every quorum and heals a peer
from another's state over HTTP): the coordinator (`actors.recovery`) lets the survivors finish the failed step
and the one queued after it, replaces the dropped replica's ranks and sets the world up again (every rank;
the survivors keep their own state, and are paused only for that rendezvous), then drives the survivors' steps
while the rebuilt replica sits out (`round_of`: its ranks answer at once, running nothing). At the next sync
(`rejoin_step`) the rebuilt ranks take part in it with weight 0 (`ReplicaSync.synchronise(live=...)` averages
over the live replicas only), then take the whole state (parameters, inner moments, outer momentum) by
broadcast from the lowest live replica, and the round is whole again. While a replica sits out, nothing
crosses replicas but that sync (each replica's loss is its own; a validation pass waits for the rejoin).

Written by hand: torch has no local SGD. torchft has LocalSGD and DiLoCo, but as wrappers over its own
fault-tolerant manager (lighthouse, quorum, its process groups); the math here is torchft's: the outer
optimizer is torch's own SGD (nesterov) over the anchor, its `.grad` the pseudo-gradient. The pure rules (when
to sync, the bytes it sends) come first; `ReplicaSync` runs the collective on a rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.parallel.plan.replica_sync import FP32

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from trainyard.parallel.config import SyncConfig
    from trainyard.parallel.plan import Plan

def saved_outer_state(directory: Path) -> bool:
    """Whether the checkpoint in `directory` holds diloco's outer momentum (one of an allreduce job does not: a
    diloco job resumed from it starts its momentum at zero)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return any(key.startswith("sync.") for key in keys)


def replica_group(plan: Plan) -> dist.ProcessGroup | None:
    """This rank's data-parallel replica (its whole pp x tp group, of `reduce_dp` dp ranks) as a process group,
    every rank creating every replica's; None when a replica is one rank. A local_sgd or diloco replica clips its
    gradients' norm over it."""
    import torch.distributed as dist

    rd = plan.reduce_dp
    replicas = [[plan.rank_of(p, t, b * rd + i) for p in range(plan.pp) for t in range(plan.tp) for i in range(rd)]
                for b in range(plan.dp // rd)]
    if len(replicas[0]) == 1:
        return None
    mine, _ = dist.new_subgroups_by_enumeration(replicas)
    return mine


class ReplicaSync:
    """One rank's part of the synchronisations of a local_sgd or diloco job: `params` are this rank's parameters
    (DTensors with tp or ZeRO-2/3; the math runs on their local shards), `group` the ranks holding the same shard
    in every replica (same pp, tp and place in the replica: each replica's shards are averaged with the same
    shards of the others), `dp` the replicas."""

    def __init__(self, cfg: SyncConfig, params: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int,
                 apart: frozenset[int] = frozenset()):
        """`apart`: indices in `params` of the copies of a tied embedding (`parallel.runtime.tied`), each averaged
        in an all-reduce of its own, so the first stage's copy and the last stage's, equal going in, come out
        equal: the same values at the same places of a buffer of the same size, over as many replicas (in one
        buffer with the rest of a stage, a sum of more than two could be rounded in another order on each)."""
        from torch.distributed.tensor import DTensor
        from trainyard.parallel.optim.dynamo_free import SGD

        self.cfg, self.group, self.dp, self.layouts, self.apart = cfg, group, dp, params, apart
        self.params = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        self.anchor: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None
        if cfg.kind == "diloco":
            self.anchor = [p.detach().clone() for p in self.params]  # local shards, as the mean is
            momentum = cfg.outer_momentum
            self.outer = SGD(self.anchor, lr=cfg.outer_lr, momentum=momentum, nesterov=momentum > 0)

    def bytes_per_sync(self) -> int:
        return FP32 * sum(p.numel() for p in self.params)

    def synchronise(self, optimizer_state: Sequence[torch.Tensor] = (), live: tuple[int, ...] | None = None,
                    replica: int = 0, state_apart: Sequence[torch.Tensor] = ()) -> int:
        """Average the parameters over the replicas (diloco: then the outer step, and every replica takes the new
        anchor), and the tensors of `optimizer_state` in place (`state_apart`, a tied embedding's moments, in an
        all-reduce of their own); the bytes this rank all-reduced. `live`: the replicas in the round when some are
        dropped (`round_of`); this rank's replica `replica`, if not among them, adds nothing (it is rejoining, and
        takes the result from a live replica after)."""
        import torch

        count = self.dp if live is None else len(live)
        adds = live is None or replica in live
        with torch.no_grad():
            for tensors in (optimizer_state, *([t] for t in state_apart)):
                for t, averaged in zip(tensors, self._mean(tensors, adds, count), strict=True):
                    t.copy_(averaged.view_as(t))
            together = [i for i in range(len(self.params)) if i not in self.apart]
            averages: dict[int, torch.Tensor] = {}
            for indices in (together, *([i] for i in sorted(self.apart))):
                averages |= zip(indices, self._mean([self.params[i] for i in indices], adds, count), strict=True)
            mean = [averages[i] for i in range(len(self.params))]
            if self.outer is None:
                for p, m in zip(self.params, mean, strict=True):
                    p.copy_(m.view_as(p))
            else:
                for a, m in zip(self.anchor, mean, strict=True):
                    a.grad = a - m.view_as(a)  # the pseudo-gradient
                self.outer.step()
                for p, a in zip(self.params, self.anchor, strict=True):
                    p.copy_(a)
        return self.bytes_per_sync() + FP32 * sum(t.numel() for t in [*optimizer_state, *state_apart])

    def _mean(self, tensors: Sequence[torch.Tensor], adds: bool, count: int) -> list[torch.Tensor]:
        """The replicas' mean of each tensor (flat views of one buffer), in one all-reduce."""
        import torch
        import torch.distributed as dist

        if not tensors:
            return []
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if self.group is not None:
            flat *= float(adds)
            dist.all_reduce(flat, group=self.group)
            flat /= count
        return list(torch.split(flat, [t.numel() for t in tensors]))

    def took_state(self) -> None:
        """The parameters were replaced (a checkpoint, always taken at a sync, or a replica's state): they are
        the anchor."""
        import torch

        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                a.copy_(p)

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The outer momentum buffers as local tensors (created at zero if the outer step has not run)."""
        if not self.outer_state():
            return []
        assert self.outer is not None  # outer_state() is empty without one
        return [self.outer.state[a]["momentum_buffer"] for a in self.anchor]

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
