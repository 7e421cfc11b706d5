"""The coordinator's pure parts without Ray: the transition rule `step` driven one pass at a time with
scripted outcomes (as Ray Train v2's test_controller does), and the failure, hang and scaling policies and the
resize desk that decide for it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from helpers import tiny_spec
from step_helpers import step_report
from trainyard.actors.calls import Failure
from trainyard.actors.failure_handling.default import DefaultFailurePolicy
from trainyard.actors.failure_handling.hang import HangPolicy
from trainyard.actors.failure_handling.policy import FailureAction, FailurePolicy
from trainyard.actors.failure_handling.replicas import live_point, replica_sources, replicas_may_recover
from trainyard.actors.scaling_policy.resize_desk import Resize, ResizeDesk
from trainyard.actors.scaling_policy.scaling import ElasticScaling, FixedScaling, NoopDecision, ResizeDecision
from trainyard.actors.state import (
    Admitted,
    AtBoundary,
    CallFailed,
    Cancelled,
    Crashed,
    Done,
    Failed,
    Finishing,
    Inputs,
    JobStatus,
    Pending,
    Ready,
    Recovering,
    Resizing,
    Running,
    Starting,
    Stopped,
    Stopping,
    Succeeded,
    step,
)
from trainyard.parallel.config import FaultConfig
from trainyard.parallel.plan import make_plan, resized
from trainyard.parallel.spec import parse_spec

STEPS = 8
POINT = ("/ckpt/step_000000003", 3)
BUDGET_2 = DefaultFailurePolicy(max_failures=2, elastic=False)


def failure(cause: str = "rank 1 died in step 4", **kw) -> Failure:
    return Failure(cause=cause, **{"blamed": (1,), "dead": (1,), "step": 4, **kw})


def inputs(**kw) -> Inputs:
    return Inputs(steps=STEPS, **kw)


def elastic_plan(dp: int = 2):
    spec = tiny_spec(parallel={"dp": {"min": 1, "max": 4}, "microbatches": 4}, global_batch=8)
    return replace(make_plan(resized(parse_spec(spec), dp)), dp_range=(1, 4))


class Driver:
    """What the controller does around `step`, minus the actions: it counts a failure when it enters a
    counted RECOVERING (as `actors.actions.recovery` records it) and takes an accepted resize."""

    def __init__(self, policy: FailurePolicy):
        self.policy, self.state, self.causes, self.seen = policy, Pending(), [], [JobStatus.PENDING]
        self.stop = False

    def feed(self, outcome, **kw) -> None:
        self.state = step(self.state, outcome, inputs(causes=tuple(self.causes), stop=self.stop, **kw), self.policy)
        if isinstance(self.state, Recovering) and self.state.counted:
            self.causes.append(self.state.failure.cause)
        self.seen.append(self.state.status)


def test_a_job_runs_from_pending_to_succeeded():
    d = Driver(BUDGET_2)
    for outcome in (Admitted(None), Ready(), AtBoundary(STEPS, saved=False), Done()):
        d.feed(outcome)
    assert isinstance(d.state, Succeeded)
    assert d.seen == ["PENDING", "RUNNING", "RUNNING", "RUNNING", "SUCCEEDED"]


def test_a_failure_during_a_recovery_counts_and_the_job_goes_on():
    """The defect: a failure while recovering failed the job although fault.max_failures allowed more."""
    d = Driver(BUDGET_2)
    d.feed(Admitted(None))
    d.feed(Ready())
    d.feed(CallFailed(failure(), POINT))
    assert isinstance(d.state, Recovering) and d.state.restore == POINT and d.state.failure.blamed == (1,)
    d.feed(CallFailed(failure("rank 0 died in loading the checkpoint of step 3"), POINT))
    assert isinstance(d.state, Recovering) and d.state.failure.cause.startswith("rank 0")
    assert len(d.causes) == 2
    d.feed(Ready())
    d.feed(AtBoundary(STEPS, saved=False))
    d.feed(Done())
    assert isinstance(d.state, Succeeded)
    assert d.seen.count(JobStatus.RECOVERING) == 2


def test_the_failure_past_the_budget_fails_the_job_with_every_cause_wherever_it_happens():
    for where in (Running(), Recovering(failure(), POINT), Resizing(elastic_plan(), "request", 0.0),
                  Finishing(STEPS, saved=False)):
        state = step(where, CallFailed(failure("the third"), POINT), inputs(causes=("one", "two")), BUDGET_2)
        assert isinstance(state, Failed)
        assert state.error == "failure 1 of 3: one\nfailure 2 of 3: two\nfailure 3 of 3: the third"


def test_a_failure_while_resizing_is_recovered_from():
    state = step(Resizing(elastic_plan(4), "request", 0.0), CallFailed(failure(), POINT), inputs(), BUDGET_2)
    assert isinstance(state, Recovering) and state.counted and state.restore == POINT


def test_a_resize_carries_its_plan_and_reason_and_ends_running():
    plan = elastic_plan(4)
    resize = Resize(plan, "resources appeared", 12.5)
    state = step(Running(), AtBoundary(3, saved=False), inputs(resize=resize), BUDGET_2)
    assert state == Resizing(plan, "resources appeared", 12.5) and state.status is JobStatus.RESIZING
    assert isinstance(step(state, Ready(), inputs(), BUDGET_2), Running)


def test_a_stop_beats_a_resize_and_says_whether_it_suspends():
    resize = Resize(elastic_plan(4), "request", 0.0)
    for suspend in (False, True):
        state = step(Running(), AtBoundary(3, saved=True), inputs(stop=True, suspend=suspend, resize=resize), BUDGET_2)
        assert state == Stopping(suspend=suspend, steps_done=3, saved=True)
        assert isinstance(step(state, Done(), inputs(stop=True), BUDGET_2), Stopped)


def test_all_steps_done_finishes_then_succeeds_or_stops_if_asked_meanwhile():
    state = step(Running(), AtBoundary(STEPS, saved=True), inputs(), BUDGET_2)
    assert state == Finishing(STEPS, saved=True) and state.status is JobStatus.RUNNING
    assert isinstance(step(state, Done(), inputs(), BUDGET_2), Succeeded)
    assert isinstance(step(state, Done(), inputs(stop=True), BUDGET_2), Stopped)


def test_a_failure_while_stopping_fails_the_job():
    state = step(Running(), CallFailed(failure(), POINT), inputs(stop=True), BUDGET_2)
    assert isinstance(state, Failed) and state.error == failure().cause


def test_a_job_that_cannot_start_fails_without_recovering():
    raised = failure("rank 0 failed in setup", raised=(0,), dead=())
    state = step(Starting(None), CallFailed(raised, None), inputs(), BUDGET_2)
    assert state == Failed("rank 0 failed in setup")


def test_a_rank_that_dies_while_the_job_starts_is_recovered():
    """The soak found it: a node removed while a job's ranks were in setup failed the job (both ranks "died in
    setup"), as if its spec could not start; a death is the cluster's failure and is recovered like any other."""
    died = failure("rank 0 died in setup: its process exited", dead=(0,))
    assert step(Starting(None), CallFailed(died, None), inputs(), BUDGET_2) == Recovering(died, None)


def test_a_restarted_coordinator_recovers_as_a_counted_failure():
    own = Failure(cause="the coordinator died", coordinator=True)
    state = step(Pending(), Admitted(POINT), inputs(restarted=own), BUDGET_2)
    assert state == Recovering(own, POINT)
    state = step(Pending(), Admitted(POINT), inputs(restarted=own, causes=("a", "b")), BUDGET_2)
    assert isinstance(state, Failed) and "failure 3 of 3: the coordinator died" in state.error


def test_a_stop_asked_of_a_restarted_coordinator_recovers_then_stops():
    """The death came before the stop: it is a counted failure recovered from, then the stop ends the job (at the
    restored step, with its model). It used to count as a failure while stopping: FAILED, no model."""
    own = Failure(cause="the coordinator died", coordinator=True)
    state = step(Pending(), Admitted(POINT), inputs(restarted=own, stop=True), BUDGET_2)
    assert state == Recovering(own, POINT)
    state = step(step(state, Ready(), inputs(stop=True), BUDGET_2), AtBoundary(3, saved=True), inputs(stop=True),
                 BUDGET_2)
    assert state == Stopping(False, 3, True)
    state = step(Pending(), Admitted(POINT), inputs(restarted=own, stop=True, causes=("a", "b")), BUDGET_2)
    assert isinstance(state, Failed) and "failure 3 of 3: the coordinator died" in state.error  # past the budget


def test_an_elastic_job_rides_a_lost_node_without_counting_it():
    elastic = DefaultFailurePolicy(max_failures=0, elastic=True)
    state = step(Running(), CallFailed(failure(), POINT, node_lost=True), inputs(), elastic)
    assert state == Recovering(failure(), POINT, counted=False)
    fixed = DefaultFailurePolicy(max_failures=0, elastic=False)
    assert isinstance(step(Running(), CallFailed(failure(), POINT, node_lost=True), inputs(), fixed), Failed)


def test_errors_cancels_and_terminal_states():
    assert step(Running(), Crashed("boom"), inputs(), BUDGET_2) == Failed("boom")
    assert isinstance(step(Recovering(failure(), None), Cancelled(), inputs(), BUDGET_2), Stopped)
    for terminal in (Succeeded(), Stopped(), Failed("x")):
        assert terminal.status.is_terminal and step(terminal, Ready(), inputs(), BUDGET_2) is terminal
    with pytest.raises(ValueError, match="no transition from Pending on Done"):
        step(Pending(), Done(), inputs(), BUDGET_2)


# --- policies -------------------------------------------------------------------------------------------

def test_failure_policy_gives_its_reason():
    assert BUDGET_2.decide(0, node_lost=False, stopping=False).action is FailureAction.RECOVER
    decision = BUDGET_2.decide(2, node_lost=False, stopping=False)
    assert decision.action is FailureAction.RAISE and "fault.max_failures=2" in decision.reason
    assert BUDGET_2.decide(0, node_lost=False, stopping=True).reason == "the job was stopping"


def test_hang_policy_trusts_the_median_only_after_a_few_steps():
    hang = HangPolicy(FaultConfig(step_timeout_s=300, hang_factor=10, hang_floor_s=5))
    assert hang.deadline([0.1, 0.1]) == 300
    assert hang.deadline([0.1, 0.2, 0.3]) == 5  # 10 x 0.2 is under the floor
    assert hang.deadline([1.0, 2.0, 3.0, 100.0]) == 30
    assert hang.deadline([100.0] * 5) == 300


def test_scaling_policies():
    plan = elastic_plan(2)
    assert isinstance(FixedScaling().decide(plan, 10), NoopDecision)
    assert ElasticScaling().decide(plan, 2) == ResizeDecision(4, "resources appeared")
    assert isinstance(ElasticScaling().decide(plan, 1), NoopDecision)  # dp=3 does not split global_batch=8
    assert isinstance(ElasticScaling().decide(elastic_plan(4), 8), NoopDecision)


def test_an_elastic_range_gets_micro_batches_that_reach_its_max_or_is_refused_naming_what_it_reaches():
    """dp: {min: 1, max: 8} with global_batch 8 in one micro-batch kept 8 sequences a micro-batch, which no size
    above 1 splits: the job stayed at dp=1 with room for 8. The plan now splits it into 8 micro-batches of 1."""
    from trainyard.parallel.plan import PlanError

    plan = make_plan(parse_spec(tiny_spec(parallel={"dp": {"min": 1, "max": 8}}, global_batch=8)))
    assert (plan.dp, plan.microbatches, plan.micro_batch_size) == (1, 8, 1)
    assert ElasticScaling().decide(plan, 7) == ResizeDecision(8, "resources appeared")
    kept = make_plan(parse_spec(tiny_spec(parallel={"dp": {"min": 2, "max": 4}, "microbatches": 2}, global_batch=16)))
    assert (kept.microbatches, kept.micro_batch_size) == (2, 4)  # max reached already: as asked
    with pytest.raises(PlanError) as info:
        make_plan(parse_spec(tiny_spec(parallel={"dp": {"min": 1, "max": 3}}, global_batch=8)))
    assert info.value.field == "parallel.dp" and "can reach 1, 2" in info.value.message


def test_the_submit_stores_the_micro_batches_that_reach_max_with_an_event():
    from trainyard.service.manager import _reaching_max

    elastic = parse_spec(tiny_spec(parallel={"dp": {"min": 1, "max": 8}}, global_batch=8))
    stored, events = _reaching_max(elastic, [])
    assert stored.parallel.microbatches == 8 and [e["kind"] for e in events] == ["micro_batches"]
    assert "parallel.microbatches 1 -> 8" in events[0]["cause"]
    for same in (parse_spec({**tiny_spec(), "parallel": "auto"}), parse_spec(tiny_spec(parallel={"dp": 2}))):
        assert _reaching_max(same, []) == (same, [])


def test_the_resize_desk_refuses_a_second_request_while_the_first_waits_for_resources():
    """The defect: `scale` checked, awaited the reservation, then set the resize without checking again, so
    the elastic grower and a manual scale could overwrite each other."""
    plans = {dp: elastic_plan(dp) for dp in (1, 2, 4)}
    current = plans[1]

    async def scenario():
        desk, reserved, release = ResizeDesk(), asyncio.Event(), asyncio.Event()

        async def slow_reserve():
            reserved.set()
            await release.wait()
            return None

        manual = asyncio.create_task(desk.request(plans[4], "request", 1.0, lambda: True, lambda: current,
                                                  slow_reserve))
        await reserved.wait()  # the manual scale holds the desk while its resources are reserved
        grower = await desk.request(plans[2], "resources appeared", 2.0, lambda: True, lambda: current,
                                    slow_reserve)
        release.set()
        return desk, await manual, grower

    desk, manual, grower = asyncio.run(scenario())
    assert manual is None and grower == "resizing already (request)"
    assert desk.take() == Resize(plans[4], "request", 1.0) and desk.take() is None


def test_a_claim_is_dropped_when_the_job_changed_while_its_resources_were_reserved():
    plans = {dp: elastic_plan(dp) for dp in (2, 4)}
    now = {"plan": plans[2]}

    async def reserve():
        now["plan"] = elastic_plan(2)  # a recovery regrouped the job meanwhile
        return None

    async def scenario():
        desk = ResizeDesk()
        answer = await desk.request(plans[4], "request", 0.0, lambda: True, lambda: now["plan"], reserve)
        return desk, answer

    desk, answer = asyncio.run(scenario())
    assert "the job changed" in answer and desk.ready is None and desk.claimed_by is None


def test_each_rank_takes_the_state_of_the_lowest_live_replica_of_its_shard_at_the_failed_step():
    plan = make_plan(parse_spec(tiny_spec(model={"n_layer": 4}, global_batch=12,
                                         parallel={"dp": 3, "pp": 2, "microbatches": 2})))
    assert replicas_may_recover(plan)
    rank = plan.rank_of
    # Stage 0's replica 0 died; stage 1's replica 0 kept a state of another step (it is no source).
    kept = {rank(0, 0, 1): 4, rank(0, 0, 2): 4, rank(1, 0, 0): 5, rank(1, 0, 2): 4}
    sources = replica_sources(plan, kept, step=4)
    assert sources == {r: rank(0, 0, 1) if plan.coords(r).pp == 0 else rank(1, 0, 2) for r in range(plan.world_size)}
    # No replica of stage 1 holds step 4 (None: its state was being replaced): back to the checkpoint.
    assert replica_sources(plan, {rank(0, 0, 1): 4, rank(1, 0, 2): None}, step=4) is None


@pytest.mark.parametrize("spec", [
    {"parallel": {"dp": 1}},
    {"parallel": {"dp": 2, "zero": 1}},  # each replica holds a slice of the optimizer state
    {"parallel": {"dp": 2}, "fault": {"from_replica": False}},
], ids=["one-replica", "zero1", "asked-not-to"])
def test_no_recovery_from_a_replica_that_does_not_hold_the_whole_state(spec):
    assert not replicas_may_recover(make_plan(parse_spec(tiny_spec(**spec))))


def test_replicas_steps_ahead_are_taken_when_the_figures_hold_the_rows_of_the_steps_between():
    # No row past step 3: rank 1 died in step 4 or later, rank 0 finished steps 4 (figures one step late, or the
    # answer lost with rank 1) and 5 (queued behind it) and returned or kept their figures
    plan = make_plan(parse_spec(tiny_spec(parallel={"dp": 2})))
    figures = {s: (step_report(step=s, loss=2.5),) for s in (4, 5)}
    assert live_point(plan, {0: 4}, 4, {}) == ({0: 0, 1: 0}, 4)
    assert live_point(plan, {0: 5}, 4, figures) == ({0: 0, 1: 0}, 5)
    assert live_point(plan, {0: 6}, 4, figures) == ({0: 0, 1: 0}, 6)
    assert live_point(plan, {0: 5}, 4, {}) is None  # no figures of step 4: back to the checkpoint
    assert live_point(plan, {0: 6}, 4, {4: figures[4]}) is None  # none of step 5
    assert live_point(plan, {0: 7}, 4, figures) is None


def test_the_failure_policy_comes_from_the_spec_and_the_plan():
    from trainyard.actors.failure_handling.registry import failure_policy

    assert failure_policy(elastic_plan()) == DefaultFailurePolicy(max_failures=FaultConfig().max_failures, elastic=True)
    fixed = make_plan(parse_spec(tiny_spec(fault={"max_failures": 5})))
    assert failure_policy(fixed) == DefaultFailurePolicy(max_failures=5, elastic=False)


def test_a_failure_policy_is_found_by_its_name_in_the_registry(monkeypatch):
    """A new policy is a module with a `make(plan)` and one line in `registry.POLICIES`; the state machine takes
    any object with `decide` (the `FailurePolicy` protocol)."""
    from trainyard.actors.failure_handling import registry
    from trainyard.actors.failure_handling.policy import FailureDecision

    class NeverRecover:
        def decide(self, counted_before: int, *, node_lost: bool, stopping: bool,
                   out_of_memory: bool = False) -> FailureDecision:
            return FailureDecision(FailureAction.RAISE, "this policy never recovers")

    assert registry.DEFAULT == "default" and set(registry.POLICIES) == {"default"}
    monkeypatch.setitem(registry.POLICIES, "never", lambda plan: NeverRecover())
    policy = registry.failure_policy(make_plan(parse_spec(tiny_spec())), "never")
    after = step(Running(), CallFailed(failure(), POINT), inputs(), policy)
    assert isinstance(after, Failed) and "rank 1 died in step 4" in after.error
    with pytest.raises(ValueError, match="no failure policy 'nope'; known: default, never"):
        registry.failure_policy(make_plan(parse_spec(tiny_spec())), "nope")
