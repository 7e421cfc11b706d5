"""`actors.progress`: the coordinator's position between states, moved only by its named transitions."""

from trainyard.actors.progress import Progress


def test_a_replica_back_from_its_rejoin_says_the_steps_it_missed():
    p = Progress(start_step=4)
    p.resumed_at(4, failed_at=10.0, dropped={1: 7})  # replica 1 dropped after step 3, rejoins at step 7's sync
    assert p.start_step == 4 and p.failed_at == 10.0 and p.dropped == {1: 7}
    assert p.replicas_stepped(4, dp=2, stepped={0}) == {}
    assert p.recovered() == 10.0 and p.recovered() is None  # the first finished step closes the recovery
    for step in (5, 6):
        assert p.replicas_stepped(step, dp=2, stepped={0}) == {}
    assert p.replicas_stepped(7, dp=2, stepped={0, 1}) == {1: 4}  # it held 4 steps; step 7 ended with 8
    assert p.dropped == {} and p.replica_steps == [8, 8]


def test_a_recovery_from_a_checkpoint_starts_the_replicas_counts_anew():
    p = Progress()
    p.replicas_stepped(2, dp=2, stepped={0, 1})
    p.resumed_at(2, failed_at=1.0)
    assert p.replica_steps == [] and p.dropped == {}


def test_the_end_syncs_the_live_replicas_when_some_sit_out():
    p = Progress(dropped={2: 9})
    assert p.take_dropped(dp=3) == (0, 1) and p.dropped == {}
    assert p.take_dropped(dp=3) is None
