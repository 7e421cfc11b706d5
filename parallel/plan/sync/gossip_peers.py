"""Whom each replica averages with at a gossip sync (`parallel.sync.kind: gossip`): the pure peer choice, a
function of (the job's seed, the step) alone, so every rank works out the same pairing without a message.

The peers of one sync form a `peers`-regular undirected graph over the replicas: j is i's peer exactly when i is
j's (so every point-to-point send has its matching receive and the round cannot deadlock), and each replica has
the same number of peers (so the mixing matrix (I + A) / (peers + 1) is doubly stochastic: the replicas' mean is
what it was, and repeated rounds drive every replica to it when the graphs connect).

The graph is a circulant over an ordering of the replicas: each takes the `peers // 2` nearest on either side
and, when `peers` is odd, one more: with one peer its neighbour to the right or the left by the round's parity
(the ring's two perfect matchings in turn, so what one replica learns travels round the ring), with three or more
the replica opposite. `ring` orders the replicas by index; `random` by a permutation drawn from (seed, round), a
new random regular graph each round. Such a graph exists exactly when peers < replicas and peers x replicas is
even (`gossip_violation`, which the plan's rules ask).

Pure: no torch, no I/O.
"""

from __future__ import annotations

import random
from typing import Literal

Topology = Literal["ring", "random"]


def gossip_violation(replicas: int, peers: int) -> str | None:
    """Why no `peers`-regular pairing of `replicas` replicas exists, or None when one does."""
    if peers >= replicas:
        return f"peers={peers} needs at least {peers + 1} replicas, and there are {replicas}"
    if peers * replicas % 2:
        return (f"peers={peers} over {replicas} replicas: an odd number of peers pairs an even number of replicas "
                "only (each exchange takes two)")
    return None


def gossip_round(step: int, every: int) -> int:
    """The index of the sync after `step` (0-based) among a job's syncs every `every` steps."""
    return step // every


def gossip_peers(seed: int, step: int, every: int, replicas: int, peers: int,
                 topology: Topology) -> tuple[tuple[int, ...], ...]:
    """Each replica's peers (sorted) at the sync after `step`: a `peers`-regular symmetric pairing, the same on
    every rank for the same (seed, step)."""
    reason = gossip_violation(replicas, peers)
    if reason is not None:
        raise ValueError(reason)
    round_ = gossip_round(step, every)
    order = list(range(replicas))
    if topology == "random":
        random.Random(f"gossip:{seed}:{round_}").shuffle(order)
    elif topology != "ring":
        raise ValueError(f"unknown gossip topology {topology!r}")
    position = {r: p for p, r in enumerate(order)}
    out = []
    for r in range(replicas):
        p = position[r]
        offsets = [d for d in range(1, peers // 2 + 1)] + [-d for d in range(1, peers // 2 + 1)]
        if peers % 2:
            offsets.append((1 if (p + round_) % 2 == 0 else -1) if peers == 1 else replicas // 2)
        out.append(tuple(sorted(order[(p + d) % replicas] for d in offsets)))
    return tuple(out)
