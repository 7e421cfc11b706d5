"""What the sync modes share: `ParameterAveraging`, the replicas' mean of the parameters (and, at the syncs a
checkpoint follows, of the inner optimizer state), each buffer in one all-reduce, over the live replicas when some
sit out; the process group a replica clips its gradients' norm over (`replica_group`); and whether a checkpoint
holds a mode's own state (`saved_outer_state`). A mode subclasses `ParameterAveraging` and says what it does with
the mean (`_take`). Imports no torch at module level.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.parallel.plan.sync.replica_sync import FP32

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from trainyard.parallel.config import SyncConfig
    from trainyard.parallel.plan import Plan


def saved_outer_state(directory: Path) -> bool:
    """Whether the checkpoint in `directory` holds a sync mode's own state (diloco's outer momentum; one of an
    allreduce job does not: a diloco job resumed from it starts its momentum at zero)."""
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


class ParameterAveraging:
    """One rank's part of the synchronisations of a mode that averages the replicas' parameters: `params` are
    this rank's parameters (DTensors with tp or ZeRO-2/3; the math runs on their local shards), `group` the ranks
    holding the same shard in every replica (same pp, tp and place in the replica: each replica's shards are
    averaged with the same shards of the others), `dp` the replicas."""

    def __init__(self, cfg: SyncConfig, params: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int,
                 apart: frozenset[int] = frozenset()):
        """`apart`: indices in `params` of the copies of a tied embedding (`parallel.runtime.pipeline.tied`), each
        averaged in an all-reduce of its own, so the first stage's copy and the last stage's, equal going in, come out
        equal: the same values at the same places of a buffer of the same size, over as many replicas (in one
        buffer with the rest of a stage, a sum of more than two could be rounded in another order on each)."""
        from torch.distributed.tensor import DTensor

        self.cfg, self.group, self.dp, self.layouts, self.apart = cfg, group, dp, params, apart
        self.params = [p.to_local() if isinstance(p, DTensor) else p for p in params]

    def bytes_per_sync(self) -> int:
        return FP32 * sum(p.numel() for p in self.params)

    def synchronise(self, optimizer_state: Sequence[torch.Tensor] = (), live: tuple[int, ...] | None = None,
                    replica: int = 0, state_apart: Sequence[torch.Tensor] = (), *, step: int = 0, seed: int = 0,
                    whole: bool = True) -> int:
        """Average the parameters over the replicas, which the mode then takes (`_take`), and the tensors of
        `optimizer_state` in place (`state_apart`, a tied embedding's moments, in an all-reduce of their own); the
        bytes this rank all-reduced. `live`: the replicas in the round when some are dropped (`round_of`); this
        rank's replica `replica`, if not among them, adds nothing (it is rejoining, and takes the result from a
        live replica after). Every sync here is whole (`step`, `seed` and `whole` are gossip's)."""
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
            self._take([averages[i] for i in range(len(self.params))])
        return self.bytes_per_sync() + FP32 * sum(t.numel() for t in [*optimizer_state, *state_apart])

    def _take(self, mean: list[torch.Tensor]) -> None:
        """What the mode makes of the replicas' mean of each parameter (flat, in the order of `params`), under
        no_grad: every replica's parameters must come out equal."""
        raise NotImplementedError

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
        """The parameters were replaced (a checkpoint, always taken at a sync, or a replica's state): nothing of
        the mode's depends on them."""

    def outer_state(self) -> list[torch.Tensor]:
        """No state of the mode's own to checkpoint."""
        return []

    def momentum_buffers(self) -> list[torch.Tensor]:
        """No state of the mode's own for a rejoining replica."""
        return []
