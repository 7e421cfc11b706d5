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


def test_checkpoints_failing_in_a_row_fail_the_job_at_the_limit_and_a_written_one_resets_the_count(tmp_path):
    import pytest
    from helpers import tiny_spec
    from trainyard.actors.calls import Unrecoverable
    from trainyard.actors.controller import Controller
    from trainyard.actors.storage import JobStorage
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.spec import parse_spec

    plan = make_plan(parse_spec(tiny_spec(steps=20, checkpoint={"every": 2, "max_write_failures": 2})))
    ctl = Controller("job", plan, None, JobStorage(str(tmp_path / "ckpt"), str(tmp_path / "model")), False)
    full = "the checkpoint of step 2 was not written: OSError: No space left"
    ctl.recorder.checkpoint_written(1, full)
    ctl.recorder.checkpoint_written(3, None)  # space came back: the count starts over
    ctl.recorder.checkpoint_written(5, full)
    with pytest.raises(Unrecoverable, match="2 checkpoints in a row could not be written"):
        ctl.recorder.checkpoint_written(7, full)
    assert [e["in_a_row"] for e in ctl.journal.events if e["kind"] == "checkpoint_failed"] == [1, 1, 2]


def test_the_journal_keeps_what_a_refused_write_left_and_writes_it_with_the_next_that_succeeds(tmp_path):
    """A write the file system refuses (a full disk; here a file where the folder should be) keeps its lines in
    memory, and they go out in order with the next append that succeeds."""
    from trainyard.actors.journal import AppendOnly, _lines

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the folder should be")
    log = AppendOnly(blocked / "journal.jsonl")
    assert log.append({"n": 1}) == 0 and log.append({"n": 2}) == 0 and len(log.pending) == 2
    blocked.unlink()
    assert log.append({"n": 3}) > 0 and log.pending == []
    assert _lines(blocked / "journal.jsonl") == [{"n": 1}, {"n": 2}, {"n": 3}]
