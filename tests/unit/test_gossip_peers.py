"""The gossip sync's pure peer choice (`parallel.plan.sync.gossip_peers`): symmetric, regular, deterministic by
(seed, step), ring versus random."""

from __future__ import annotations

import pytest
from trainyard.parallel.plan.sync.gossip_peers import gossip_peers, gossip_violation

CASES = [(replicas, peers) for replicas in range(2, 9) for peers in range(1, replicas) if peers * replicas % 2 == 0]


@pytest.mark.parametrize("topology", ["ring", "random"])
@pytest.mark.parametrize(("replicas", "peers"), CASES)
def test_every_pairing_is_symmetric_and_regular_so_no_exchange_waits_forever(topology, replicas, peers):
    for step in range(6):
        graph = gossip_peers(7, step, 1, replicas, peers, topology)
        assert len(graph) == replicas
        for i, mine in enumerate(graph):
            assert len(set(mine)) == peers and i not in mine  # k distinct others
            assert all(i in graph[j] for j in mine)  # each send has its receive


def test_the_ring_pairs_neighbours_and_one_peer_alternates_the_two_matchings():
    assert gossip_peers(0, 0, 1, 6, 2, "ring") == ((1, 5), (0, 2), (1, 3), (2, 4), (3, 5), (0, 4))
    assert gossip_peers(0, 0, 1, 4, 1, "ring") == ((1,), (0,), (3,), (2,))
    assert gossip_peers(0, 1, 1, 4, 1, "ring") == ((3,), (2,), (1,), (0,))
    # every H steps: the round is the sync's index, not the step's parity (H = 2 would otherwise repeat one matching)
    assert gossip_peers(0, 1, 2, 4, 1, "ring") == gossip_peers(0, 0, 1, 4, 1, "ring")
    assert gossip_peers(0, 3, 2, 4, 1, "ring") == gossip_peers(0, 1, 1, 4, 1, "ring")
    # the ring ignores the seed
    assert gossip_peers(1, 5, 1, 8, 3, "ring") == gossip_peers(2, 5, 1, 8, 3, "ring")


def test_all_other_replicas_as_peers_is_everyone():
    for replicas in (2, 3, 4, 5):
        for topology in ("ring", "random"):
            graph = gossip_peers(3, 0, 1, replicas, replicas - 1, topology)
            assert graph == tuple(tuple(j for j in range(replicas) if j != i) for i in range(replicas))


def test_random_pairings_are_fixed_by_seed_and_step_and_change_with_them():
    one = [gossip_peers(11, step, 1, 8, 2, "random") for step in range(8)]
    assert one == [gossip_peers(11, step, 1, 8, 2, "random") for step in range(8)]  # deterministic
    assert len(set(one)) > 1  # a new graph as the rounds go on
    assert one != [gossip_peers(12, step, 1, 8, 2, "random") for step in range(8)]  # another seed, other graphs
    assert any(g != gossip_peers(11, 0, 1, 8, 2, "ring") for g in one)  # not the ring


def test_impossible_pairings_are_named():
    assert gossip_violation(4, 4) == "peers=4 needs at least 5 replicas, and there are 4"
    assert "odd number of peers" in (gossip_violation(3, 1) or "")
    assert gossip_violation(4, 3) is None
    with pytest.raises(ValueError, match="odd number of peers"):
        gossip_peers(0, 0, 1, 5, 1, "ring")
