"""`actors.client_turns.Turns`: each tenant's calls in their numbered order, one at a time, and a round robin by user
across tenants (a user with two clients and many calls queued takes no more turns than one with one)."""

from __future__ import annotations

from trainyard.actors.client_turns import Turns


def _drain(turns: Turns) -> list[tuple[str, int]]:
    order = []
    while (call := turns.pick()) is not None:
        turns.start(*call)
        assert turns.pick() is None  # one call at a time on the ranks
        turns.done(call[0])
        order.append(call)
    return order


def test_users_take_turns_whatever_their_tenants_and_queued_calls():
    turns = Turns()
    for seq in range(4):
        turns.arrive("a1", seq, "alice")
        turns.arrive("a2", seq, "alice")
    for seq in range(2):
        turns.arrive("b1", seq, "bob")
    order = _drain(turns)
    users = ["alice" if t.startswith("a") else "bob" for t, _ in order]
    assert users[:4] == ["alice", "bob", "alice", "bob"]  # bob's two calls interleave with alice's first two
    assert [t for t, _ in order[:4] if t.startswith("a")] == ["a1", "a2"]  # alice's turns alternate her tenants
    for tenant in ("a1", "a2", "b1"):
        assert [s for t, s in order if t == tenant] == sorted(s for t, s in order if t == tenant)
    assert len(order) == 10


def test_a_call_waits_for_its_tenants_earlier_call():
    turns = Turns()
    turns.arrive("a", 1, "alice")  # delivered before call 0
    assert turns.pick() is None
    turns.arrive("a", 0, "alice")
    assert _drain(turns) == [("a", 0), ("a", 1)]
