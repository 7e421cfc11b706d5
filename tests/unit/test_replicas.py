"""The pure parts of recovering from live replicas at (dp, pp) > 1 (`actors.failure_handling.replicas`,
`actors.telemetry`): which ranks are replaced so that none stays blocked on a dead peer, and which answers make the
failed step's row (any whole pipeline, not only replica 0's); and of replicas that fail alone (local_sgd, diloco:
`parallel.sync`, `replicas.replicas_to_drop`): which replicas take part in a round, when a dropped one rejoins, and
which failures drop a replica rather than go back to the checkpoint."""

from __future__ import annotations

from helpers import tiny_spec
from step_helpers import step_report
from trainyard.actors.failure_handling.replicas import complete_pipeline, live_point, replicas_to_replace
from trainyard.actors.telemetry import make_row
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.step.step_stats import StepReport, StepStats
from trainyard.parallel.spec import parse_spec

PLAN = make_plan(parse_spec(tiny_spec(model={"n_layer": 4}, parallel={"dp": 2, "pp": 2, "microbatches": 2})))


def answer(pp: int, dp: int, step: int = 6, forward_s: float = 0.1) -> StepReport:
    return step_report(step=step, loss=2.5 if pp == 1 else None, pp_rank=pp, dp_rank=dp, forward_s=forward_s)


def stats(*answers: StepReport) -> list[StepStats]:
    return [a.stats for a in answers if a.stats is not None]


def test_the_replica_of_a_dead_rank_is_replaced_whole_so_no_rank_stays_blocked_on_it():
    rank = PLAN.rank_of
    assert replicas_to_replace(PLAN, {rank(0, 0, 1)}) == {rank(0, 0, 1), rank(1, 0, 1)}
    # A dead rank in every replica: nothing is left to take the state from, so nothing more is replaced.
    assert replicas_to_replace(PLAN, {rank(0, 0, 1), rank(1, 0, 0)}) == set()


def test_any_whole_pipeline_makes_the_row_of_a_step_whose_answer_died_with_a_rank():
    rank = PLAN.rank_of
    # Replica 0's stage-0 rank died after finishing step 6; only replica 1's pipeline answered that step, and
    # the ranks kept (replica 1's) hold 7 steps.
    answered = (answer(0, 1), answer(1, 1))
    assert complete_pipeline(stats(*answered), PLAN.pp) == 1
    assert complete_pipeline(stats(answer(0, 1), answer(1, 0)), PLAN.pp) is None
    kept = {rank(0, 0, 1): 7, rank(1, 0, 1): 7}
    sources, step = live_point(PLAN, kept, 6, {6: answered})
    assert step == 7 and sources == {r: rank(PLAN.coords(r).pp, 0, 1) for r in range(PLAN.world_size)}
    assert live_point(PLAN, kept, 6, {6: (answer(0, 1),)}) is None  # no whole pipeline: back to the checkpoint

    row = make_row(6, list(answered), elapsed=0.5, tokens=256)
    assert row.loss == 2.5 and row.stage_forward_s == [0.1, 0.1]
    both = [answer(0, 0, forward_s=0.3), answer(1, 0, forward_s=0.3), *answered]
    assert make_row(6, both, elapsed=0.5, tokens=256).stage_forward_s == [0.3, 0.3]  # replica 0's when whole


def test_a_dropped_replica_sits_out_until_the_next_sync_and_rejoins_in_it():
    from trainyard.parallel.config import SyncConfig
    from trainyard.parallel.plan.sync.replica_sync import rejoin_step, round_of

    cfg = SyncConfig(kind="diloco", every=8)
    assert rejoin_step(5, cfg, steps=20) == 7 and rejoin_step(8, cfg, steps=20) == 15
    assert rejoin_step(17, cfg, steps=20) == 19  # the last step always syncs
    dropped = {2: 7}
    assert [round_of(s, 4, dropped) for s in (5, 6)] == [((0, 1, 3), ())] * 2
    assert round_of(7, 4, dropped) == ((0, 1, 3), (2,))  # it takes part in the sync, with weight 0
    assert round_of(8, 4, dropped) is None and round_of(8, 4, {}) is None


def test_only_a_local_sync_replica_whose_rank_died_alone_is_dropped():
    from trainyard.actors.failure_handling.replicas import replicas_to_drop

    def plan_of(sync, **parallel):
        return make_plan(parse_spec(tiny_spec(model={"n_layer": 4}, global_batch=16,
                                              parallel={"dp": 4, **parallel, "sync": sync})))

    diloco = plan_of({"kind": "diloco", "every": 8})
    assert replicas_to_drop(diloco, {2}, set(), {}) == {2}
    assert replicas_to_drop(diloco, {2}, {0}, {}) is None  # rank 0 raised: it was in a sync with rank 2
    assert replicas_to_drop(diloco, set(), {2}, {}) is None  # a hang or an error: no replica lost
    assert replicas_to_drop(diloco, {0, 1, 2, 3}, set(), {}) is None
    assert replicas_to_drop(diloco, {1}, set(), {2: 7}) is None  # one dropped already: the checkpoint
    assert replicas_to_drop(plan_of({"kind": "allreduce"}), {2}, set(), {}) is None
    pp2 = plan_of({"kind": "local_sgd", "every": 4}, pp=2, microbatches=2)
    assert replicas_to_drop(pp2, {pp2.rank_of(1, 0, 3)}, {pp2.rank_of(0, 0, 3)}, {}) == {3}
