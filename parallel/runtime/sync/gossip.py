"""`parallel.sync.kind: gossip` (Boyd et al. 2006's randomized gossip; Lian et al. 2017's decentralised SGD): each
replica steps alone, as with local_sgd; every `every` steps it averages its parameters with `peers` other replicas
only, chosen by (seed, step) (`parallel.plan.sync.gossip_peers`: a symmetric regular pairing, ring or random), and goes
on from that mean. No collective spans the replicas: each exchange is a point-to-point send and receive
(`batch_isend_irecv`) on the replicas' group, so a sync costs `peers` copies of the parameters whatever dp is, and
the replicas agree more with each round without ever waiting on all of them.

The inner optimizer's moments stay each replica's own between syncs, as local_sgd's. The syncs that must leave one
model (after the last step, before a checkpoint, which also averages the moments, and the round a dropped replica
rejoins at: `replica_sync.whole_sync`, or `live` given) are local_sgd's mean over every replica. No state of its own.

Written by hand: torch has no gossip averaging. Each rank sums its own buffer and its peers' in the order of the
replicas' indices, so two ranks holding equal tensors (a tied embedding's two copies) come out equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainyard.parallel.plan.sync.gossip_peers import gossip_peers
from trainyard.parallel.plan.sync.replica_sync import FP32
from trainyard.parallel.runtime.sync.local_sgd import LocalSGD

if TYPE_CHECKING:
    import torch


class Gossip(LocalSGD):
    """Every replica takes the mean of its parameters and its peers'; at a whole sync, local_sgd's mean."""

    def synchronise(self, optimizer_state: Sequence[torch.Tensor] = (), live: tuple[int, ...] | None = None,
                    replica: int = 0, state_apart: Sequence[torch.Tensor] = (), *, step: int = 0, seed: int = 0,
                    whole: bool = True) -> int:
        """A gossip round with this replica's peers at the sync after `step`; local_sgd's average where the sync
        is `whole`, some replicas are out of the round (`live`) or the moments are averaged too. The bytes this
        rank sent."""
        if whole or live is not None or optimizer_state or state_apart or self.group is None:
            return super().synchronise(optimizer_state, live, replica, state_apart)
        import torch
        import torch.distributed as dist

        me = dist.get_rank(self.group)
        peers = gossip_peers(seed, step, self.cfg.every, self.dp, self.cfg.peers, self.cfg.topology)[me]
        with torch.no_grad():
            mine = torch.cat([p.reshape(-1) for p in self.params])
            theirs = {peer: torch.empty_like(mine) for peer in peers}
            ops = [op for peer in peers for op in (
                dist.P2POp(dist.isend, mine, group=self.group, group_peer=peer),
                dist.P2POp(dist.irecv, theirs[peer], group=self.group, group_peer=peer))]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            buffers = theirs | {me: mine}
            total = torch.zeros_like(mine)
            for index in sorted(buffers):  # one order on every rank
                total += buffers[index]
            total /= len(buffers)
            self._take(list(torch.split(total, [p.numel() for p in self.params])))
        return FP32 * mine.numel() * len(peers)
