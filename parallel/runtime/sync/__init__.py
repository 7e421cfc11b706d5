"""The replica sync room: how data-parallel replicas keep in step (`parallel.sync`), a replica being a whole pp x tp
group of one or (`parallel.sync.replicas`) several dp ranks, which share ZeRO's shards and MoE's experts.

Owns the registry of sync modes (`SYNCS`, by the spec's `parallel.sync.kind`), the protocol a mode's object
implements on a rank (`ReplicaSync`: what the trainer and `parallel.runtime.rank_state` ask of it), one module per
mode (`local_sgd`, `diloco`, `gossip`) and the machinery they share (`averaging`: the replicas' mean, the process
group a replica clips over, whether a checkpoint holds a mode's own state). The pure facts of each mode (whether its
replicas step apart, when they sync, the bytes they send, what the plan shows) are
`parallel.plan.sync.replica_sync.SYNC_KINDS`, under the same names.

- `allreduce` (the default): the gradient reducer (`parallel.runtime.dp.data_parallel`) sums every gradient across the
  replicas every step; nothing here runs (its entry is None).
- `local_sgd` (Stich 2019, Lin et al. 2020): each replica steps on its own share of the step's global batch
  (the layout-independent sampler's, as always), with no traffic between replicas; every `every` steps (and
  after the last) the replicas' parameters are averaged.
- `parameter_server`: the replicas push their gradients (a bucket per shard) to `shards` server actors
  (`actors.ps_shard`), each owning a share of the parameters and their optimizer state, and pull the parameters
  back; BSP, ASP or SSP (`parallel.plan.sync.parameter_server`). The rank's side is `parameter_server.ServerClient`, the
  shard's math `parameter_server.ShardState`; it averages nothing, so its entry here is None.
- `diloco` (Douillard et al. 2023): as local_sgd, but the averaged change since the last sync goes through an
  outer Nesterov SGD over the anchor (the parameters of the last sync).
- `gossip` (Boyd et al. 2006; Lian et al. 2017's decentralised SGD): as local_sgd, but a sync averages each replica
  with `peers` others only (`parallel.plan.sync.gossip_peers`), by point-to-point messages, no collective; the syncs
  that must leave one model (the last, a checkpoint's, a rejoin's) are local_sgd's.

So the link between replicas carries the parameters once per `every` steps instead of the gradients every step.
Each replica's inner optimizer state stays its own, except at the syncs a `checkpoint.every` checkpoint follows:
there the replicas also average it, so the checkpoint (which holds one copy of what the replicas share) is the
whole state, and a resumed run follows the uninterrupted one exactly (both average at those steps). The job's
last checkpoint (after its last step, or a stop or resize between syncs, which syncs the parameters first:
`syncs_before_save`) continues no run exactly (a longer job has another learning-rate schedule), so it spends
no bytes on the moments: it holds data-parallel replica 0's (`checkpoint.save(from_lowest_rank=True)`), as a
torchft replica that heals takes a live peer's. A mode's own state (diloco's outer momentum) is saved under
`sync.` (`ReplicaSync.outer_state`).

Replicas that fail alone: between syncs no replica waits on another, so when a rank dies its replica (its whole
pp x tp group) is dropped from the round and the others go on stepping. The design, smaller than torchft's (whose
Manager reconfigures its process groups for every quorum and heals a peer from another's state over HTTP): the
coordinator (`actors.actions.recovery`) lets the survivors finish the failed step and the one queued after it, replaces
the dropped replica's ranks and sets the world up again (every rank; the survivors keep their own state, and are
paused only for that rendezvous), then drives the survivors' steps while the rebuilt replica sits out
(`round_of`: its ranks answer at once, running nothing). At the next sync (`rejoin_step`) the rebuilt ranks take
part in it with weight 0 (`ReplicaSync.synchronise(live=...)` averages over the live replicas only), then take the
whole state (parameters, inner moments, the mode's own state: `momentum_buffers`) by broadcast from the lowest
live replica, and the round is whole again. While a replica sits out, nothing crosses replicas but that sync (each
replica's loss is its own; a validation pass waits for the rejoin).

Written by hand: torch has no local SGD. torchft has LocalSGD and DiLoCo, but as wrappers over its own
fault-tolerant manager (lighthouse, quorum, its process groups); the math here is torchft's. Imports no torch at
module level (the names are read without it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from trainyard.parallel.names import SYNC_NAMES, SyncName, registry
from trainyard.parallel.runtime.sync.averaging import replica_group, saved_outer_state
from trainyard.parallel.runtime.sync.diloco import DiLoCo
from trainyard.parallel.runtime.sync.gossip import Gossip
from trainyard.parallel.runtime.sync.local_sgd import LocalSGD

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from trainyard.parallel.config import SyncConfig

__all__ = ["NAMES", "SYNCS", "ReplicaSync", "SyncFactory", "make_replica_sync", "replica_group", "saved_outer_state"]


class ReplicaSync(Protocol):
    """One rank's part of the synchronisations of a mode whose replicas step apart."""

    def synchronise(self, optimizer_state: Sequence[torch.Tensor] = (), live: tuple[int, ...] | None = None,
                    replica: int = 0, state_apart: Sequence[torch.Tensor] = (), *, step: int = 0, seed: int = 0,
                    whole: bool = True) -> int:
        """Bring the replicas' parameters together (and average the tensors of `optimizer_state` in place,
        `state_apart` each in an all-reduce of its own); the bytes this rank sent. `live`: the replicas in
        the round when some are dropped (`round_of`); this rank's replica `replica`, if not among them, adds
        nothing (it is rejoining, and takes the result from a live replica after). `step`, `seed`: the sync's
        (gossip picks its peers by them); `whole`: the sync must leave one model (`replica_sync.whole_sync`:
        gossip then averages over every replica; the other modes always do)."""
        ...

    def took_state(self) -> None:
        """The parameters were replaced (a checkpoint, always taken at a sync, or a replica's state)."""
        ...

    def outer_state(self) -> list[torch.Tensor]:
        """The mode's own state for a checkpoint, one tensor per parameter laid out like it (saved under `sync.`;
        diloco's outer momentum), or none."""
        ...

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The same state as local tensors, which a rejoining replica takes by broadcast (none: [])."""
        ...


SyncFactory = Callable[["SyncConfig", list["torch.Tensor"], "dist.ProcessGroup | None", int, frozenset[int]],
                       ReplicaSync]
"""A mode's `ReplicaSync` from (its config, this rank's parameters, the ranks holding the same shard in every replica,
the replicas, the indices in the parameters of a tied embedding's copies: see `averaging.ParameterAveraging`)."""

SYNCS: dict[SyncName, SyncFactory | None] = registry(SYNC_NAMES, {
    "allreduce": None,
    "local_sgd": LocalSGD,
    "diloco": DiLoCo,
    "gossip": Gossip,
    "parameter_server": None,  # no parameter averaging: the rank's client is `parameter_server.ServerClient`
}, "the replica sync modes")
"""The sync modes by the spec's `parallel.sync.kind`; None: the replicas step together (the reducers sum the
gradients), nothing to build."""
NAMES = tuple(SYNCS)


def make_replica_sync(cfg: SyncConfig, params: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int,
                      apart: frozenset[int] = frozenset()) -> ReplicaSync | None:
    """This rank's part of `cfg.kind`'s syncs over `dp` replicas (None where the replicas step together)."""
    factory = SYNCS[cfg.kind]
    return None if factory is None else factory(cfg, params, group, dp, apart)
