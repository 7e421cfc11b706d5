"""Pipeline schedules and their simulator: closed-form bubbles, activation peaks, refusals, validation."""

from __future__ import annotations

from typing import get_args

import pytest
from helpers import tiny_spec
from trainyard.parallel.config import ScheduleKind
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.plan.present import describe
from trainyard.parallel.plan.schedule.actions import Action, ActionKind, ScheduleError, format_actions, parse_actions
from trainyard.parallel.plan.schedule.schedule_sim import render_gantt, simulate, steady_state
from trainyard.parallel.plan.schedule.schedule_timing import Costs
from trainyard.parallel.plan.schedule.schedules import SCHEDULE_KINDS, build_schedule, check_schedule_args, placement_of
from trainyard.parallel.spec import parse_spec

# (pp, microbatches): multiples of pp, non-multiples, fewer micro-batches than ranks, and a single rank.
PP_M = [(2, 4), (4, 8), (3, 7), (4, 6), (4, 2), (3, 1), (1, 5)]


def run(kind: str, pp: int, m: int, vpp: int = 1, costs: Costs = Costs()):
    return simulate(build_schedule(kind, pp, m, vpp), m, vpp, costs)


def closed_form(pp: int, m: int, vpp: int = 1) -> float:
    return (pp - 1) / (vpp * m + pp - 1)


@pytest.mark.parametrize(("pp", "m"), PP_M)
def test_gpipe_bubble_matches_closed_form(pp, m):
    assert run("gpipe", pp, m).bubble_fraction == pytest.approx(closed_form(pp, m))


@pytest.mark.parametrize(("pp", "m"), PP_M)
def test_1f1b_bubble_matches_closed_form(pp, m):
    assert run("1f1b", pp, m).bubble_fraction == pytest.approx(closed_form(pp, m))


@pytest.mark.parametrize(("pp", "m", "vpp"), [
    (2, 4, 2), (4, 8, 2), (4, 8, 3), (3, 6, 4), (4, 4, 2),  # m a multiple of pp
    (2, 5, 2), (4, 6, 2), (3, 7, 3), (4, 9, 2), (4, 11, 4),  # m not a multiple of pp (Megatron's groups)
])
def test_interleaved_divides_the_bubble_by_vpp(pp, m, vpp):
    bubble = run("interleaved-1f1b", pp, m, vpp).bubble_fraction
    assert bubble == pytest.approx(closed_form(pp, m, vpp))
    assert bubble < run("1f1b", pp, m).bubble_fraction


@pytest.mark.parametrize(("pp", "m", "vpp"), [(2, 4, 2), (3, 7, 3), (4, 8, 2)])
def test_gpipe_with_virtual_stages_matches_interleaved_bubble_but_holds_every_activation(pp, m, vpp):
    looped = run("gpipe", pp, m, vpp)
    assert looped.bubble_fraction == pytest.approx(closed_form(pp, m, vpp))
    assert looped.peak_activations == [m * vpp] * pp
    assert max(run("interleaved-1f1b", pp, m, vpp).peak_activations) < m * vpp


def test_gpipe_with_virtual_stages_and_few_microbatches_still_beats_1f1b():
    # With m < pp the first rank waits for the wrapped-around activation: not the closed form, but better.
    bubble = run("gpipe", 4, 2, 2).bubble_fraction
    assert closed_form(4, 2, 2) < bubble < closed_form(4, 2)


@pytest.mark.parametrize(("pp", "m"), PP_M)
def test_gpipe_holds_every_microbatch_on_every_rank(pp, m):
    assert run("gpipe", pp, m).peak_activations == [m] * pp


@pytest.mark.parametrize(("pp", "m"), PP_M)
def test_1f1b_holds_at_most_pp_minus_rank_activations(pp, m):
    peaks = run("1f1b", pp, m).peak_activations
    assert peaks == [min(pp - rank, m) for rank in range(pp)]
    assert max(peaks) <= pp


@pytest.mark.parametrize(("pp", "m", "vpp"), [(2, 4, 2), (4, 8, 2), (4, 16, 3)])
def test_interleaved_holds_megatron_warmup_plus_one_activations(pp, m, vpp):
    peaks = run("interleaved-1f1b", pp, m, vpp).peak_activations
    assert peaks == [min(2 * (pp - rank - 1) + (vpp - 1) * pp + 1, m * vpp) for rank in range(pp)]


def test_interleaved_with_m_not_a_multiple_of_pp_follows_megatrons_table():
    # Megatron-LM's documented table for PP2 M5 VP2 with groups of 3 micro-batches (the smallest group size
    # whose remainder is 0 or at least pp): micro-batch 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1.
    forwards = [(a.microbatch, a.chunk) for a in build_schedule("interleaved-1f1b", 2, 5, 2)[0]
                if a.kind is ActionKind.FORWARD]
    assert forwards == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]


def test_interleaved_with_an_awkward_m_needs_a_larger_group_and_more_memory():
    # pp=4, m=6: no group size in 4..5 leaves a remainder of 0 or >= 4, so the group is all 6 micro-batches
    # and rank 0 runs every forward before its first backward; the bubble still divides by vpp.
    result = run("interleaved-1f1b", 4, 6, 2)
    assert result.peak_activations == [12, 11, 9, 7]
    assert result.bubble_fraction == pytest.approx(closed_form(4, 6, 2))


OFFERED = [  # every combination here must build and pass the simulator, whatever the costs
    ("gpipe", 1, 1, 1), ("gpipe", 1, 3, 2), ("gpipe", 2, 3, 1), ("gpipe", 3, 5, 1), ("gpipe", 4, 2, 1),
    ("gpipe", 2, 3, 2), ("gpipe", 4, 6, 3), ("gpipe", 4, 2, 2),
    ("1f1b", 1, 1, 1), ("1f1b", 1, 4, 1), ("1f1b", 2, 1, 1), ("1f1b", 2, 3, 1), ("1f1b", 3, 5, 1),
    ("1f1b", 4, 4, 1), ("1f1b", 4, 10, 1), ("1f1b", 5, 3, 1),
    ("interleaved-1f1b", 2, 2, 2), ("interleaved-1f1b", 2, 3, 2), ("interleaved-1f1b", 2, 5, 3),
    ("interleaved-1f1b", 3, 4, 2), ("interleaved-1f1b", 3, 5, 3), ("interleaved-1f1b", 4, 6, 2),
    ("interleaved-1f1b", 4, 7, 2), ("interleaved-1f1b", 4, 13, 4), ("interleaved-1f1b", 5, 12, 2),
    ("zb-h1", 1, 3, 1), ("zb-h1", 2, 1, 1), ("zb-h1", 3, 5, 1), ("zb-h1", 4, 2, 1), ("zb-h1", 4, 8, 1),
    ("zbv", 1, 3, 2), ("zbv", 2, 1, 2), ("zbv", 2, 5, 2), ("zbv", 3, 4, 2), ("zbv", 4, 6, 2), ("zbv", 4, 9, 2),
    ("2bw", 1, 2, 1), ("2bw", 2, 4, 1), ("2bw", 4, 8, 1),
]


@pytest.mark.parametrize(("kind", "pp", "m", "vpp"), OFFERED, ids=lambda x: str(x))
def test_every_offered_combination_passes_the_simulator_under_any_costs(kind, pp, m, vpp):
    check_schedule_args(kind, pp, m, vpp)
    stages = build_schedule(kind, pp, m, vpp)
    assert len(stages) == pp
    for costs in (Costs(), Costs(1.0, 1.0, 0.0), Costs(2.0, 1.0, 0.5), Costs(0.5, 3.0, 1.0),
                  Costs(1.0, 3.0, 0.5, backward_weight=0.5)):
        result = simulate(stages, m, vpp, costs, placement_of(kind))
        assert result.makespan > 0
        assert len(result.peak_activations) == pp
    if pp == 1:
        assert not any(a.is_comm for a in stages[0])  # neighbouring chunks on one rank hand over locally


@pytest.mark.parametrize(("kind", "pp", "m", "vpp", "why"), [
    ("zero-bubble", 2, 4, 1, "unknown schedule 'zero-bubble'; expected one of gpipe, 1f1b, interleaved-1f1b, "
                            "zb-h1, zbv"),
    ("1f1b", 2, 4, 2, "1f1b needs vpp=1 (got vpp=2); use interleaved-1f1b"),
    ("interleaved-1f1b", 2, 4, 1, "interleaved-1f1b needs vpp >= 2 (got vpp=1)"),
    ("interleaved-1f1b", 1, 4, 2, "interleaved-1f1b needs pp >= 2 (got pp=1)"),
    ("interleaved-1f1b", 4, 3, 2, "interleaved-1f1b needs microbatches >= pp (got microbatches=3, pp=4)"),
    ("gpipe", 0, 4, 1, "gpipe needs pp >= 1 (got pp=0)"),
    ("1f1b", 2, 0, 1, "1f1b needs microbatches >= 1 (got microbatches=0)"),
])
def test_combinations_a_kind_cannot_run_are_refused_with_the_rule(kind, pp, m, vpp, why):
    for call in (check_schedule_args, build_schedule):
        with pytest.raises(ScheduleError) as err:
            call(kind, pp, m, vpp)
        assert why in str(err.value)


def test_every_kind_the_spec_accepts_is_built_and_offered():
    accepted = set(get_args(ScheduleKind))  # what `parallel.schedule` may say in a JobSpec
    assert set(SCHEDULE_KINDS) == accepted
    assert SCHEDULE_KINDS == get_args(ScheduleKind)  # in one order: the planner tries the spec's kinds in it
    assert {kind for kind, *_ in OFFERED} == accepted


def test_single_rank_is_plain_gradient_accumulation():
    assert format_actions(build_schedule("1f1b", 1, 3)[0]) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0"
    assert format_actions(build_schedule("gpipe", 1, 3)[0]) == "F0.0 F1.0 F2.0 B0.0 B1.0 B2.0"
    assert run("1f1b", 1, 3).bubble_fraction == 0.0


def test_1f1b_pairs_the_outgoing_activation_with_the_incoming_gradient():
    rank0, rank1 = (format_actions(actions) for actions in build_schedule("1f1b", 2, 3))
    assert rank0 == ("F0.0 [sA0.0>1] F1.0 [sA1.0>1 rG0.0<1] B0.0 F2.0 [sA2.0>1 rG1.0<1] B1.0 [rG2.0<1] B2.0")
    assert rank1 == ("[rA0.0<0] F0.0 [rA1.0<0] B0.0 [sG0.0>0] F1.0 B1.0 [rA2.0<0 sG1.0>0] F2.0 B2.0 "
                     "[sG2.0>0]")


def test_action_labels_name_kind_microbatch_chunk_and_peer():
    assert str(Action(ActionKind.FORWARD, 3, 1)) == "F3.1"
    assert str(Action(ActionKind.BACKWARD, 3, 1)) == "B3.1"
    assert str(Action(ActionKind.SEND_ACT, 3, 1, 2)) == "sA3.1>2"
    assert str(Action(ActionKind.RECV_GRAD, 3, 1, 2)) == "rG3.1<2"
    stages = build_schedule("interleaved-1f1b", 2, 4, 2)
    assert [parse_actions(format_actions(actions)) for actions in stages] == stages


def test_communication_cost_lengthens_the_step_and_shows_in_the_timeline():
    free, costly = run("1f1b", 4, 8), run("1f1b", 4, 8, costs=Costs(comm=0.5))
    assert costly.makespan > free.makespan
    assert any(a.is_comm for row in costly.timeline for _, _, a in row)
    assert not any(a.is_comm for row in free.timeline for _, _, a in row)
    assert "~" in render_gantt(costly)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_on_shared_cores_a_pipeline_that_never_overlaps_runs_every_compute_at_the_speed_of_one_alone(kind):
    """One micro-batch: no two stages ever compute at once, so each compute takes costs.shared[0] of its time."""
    plain = run(kind, 4, 1)
    shared = run(kind, 4, 1, costs=Costs(shared=(0.5, 0.7, 0.9, 1.0)))
    assert shared.makespan == pytest.approx(0.5 * plain.makespan)
    assert [2 * t for row in shared.timeline for a, b, _ in row for t in (a, b)] == pytest.approx(
        [t for row in plain.timeline for a, b, _ in row for t in (a, b)])


def test_on_shared_cores_a_compute_speeds_up_while_its_neighbour_waits_in_the_bubble():
    """gpipe, pp 2, m 2, F 1, B 2, and a stage alone twice as fast as both at once. Rank 0: F0 alone [0, .5];
    then both compute for 1 (rank 0's F1, rank 1's F0) to 1.5; rank 1's F1 alone to 2 and its first B alone to 3;
    then both for 2 (rank 0's first B, rank 1's second) to 5; rank 0's second B alone to 6 (plain: 9)."""
    costs = Costs(forward=1.0, backward=2.0, shared=(0.5, 1.0))
    assert run("gpipe", 2, 2).makespan == pytest.approx(9.0)
    got = run("gpipe", 2, 2, costs=costs)
    assert got.makespan == pytest.approx(6.0)
    assert [t for a, b, _ in got.timeline[0] for t in (a, b)] == pytest.approx([0, 0.5, 0.5, 1.5, 3, 5, 5, 6])
    assert run("gpipe", 2, 2, costs=Costs(forward=1.0, backward=2.0, shared=(1.0, 1.0))).makespan == 9.0
    # a node slower with fewer busy (a non-monotone calibration) is timed so too, not as if unshared
    assert run("gpipe", 2, 1, costs=Costs(shared=(2.0, 1.0))).makespan == pytest.approx(2 * run("gpipe", 2, 1).makespan)


@pytest.mark.parametrize(("kind", "pp", "m", "vpp"), [("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2),
                                                      ("zb-h1", 4, 6, 1), ("zb-h1", 2, 3, 1), ("gpipe", 3, 7, 1)])
def test_on_shared_cores_that_barely_share_the_timing_is_the_plain_ones(kind, pp, m, vpp):
    plain = run(kind, pp, m, vpp, Costs(backward=1.7, comm=0.3))
    nearly = run(kind, pp, m, vpp, Costs(backward=1.7, comm=0.3, shared=(1 - 1e-9,) * pp))
    assert nearly.makespan == pytest.approx(plain.makespan, rel=1e-6)
    assert nearly.bubble_fraction == pytest.approx(plain.bubble_fraction, rel=1e-5, abs=1e-6)
    assert nearly.makespan >= run(kind, pp, m, vpp, Costs(backward=1.7, comm=0.3, shared=(0.5,) * pp)).makespan


def test_gantt_has_one_row_per_rank_and_a_legend():
    chart = render_gantt(run("1f1b", 3, 4), width=60)
    lines = chart.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("legend:")
    rows = [line.split("|")[1] for line in lines[:3]]
    assert all(len(row) == 60 for row in rows)
    assert rows[0].startswith("0") and "a" in rows[0] and "." in rows[2]


# --- the validator, on hand-written tables ---

GOOD_1F1B = [  # pp=2, m=2, Megatron's pairing of a send with the opposite receive
    "F0.0 [sA0.0>1] F1.0 [sA1.0>1 rG0.0<1] B0.0 [rG1.0<1] B1.0",
    "[rA0.0<0] F0.0 B0.0 [sG0.0>0 rA1.0<0] F1.0 B1.0 [sG1.0>0]",
]


def table(*rows: str) -> list[list[Action]]:
    return [parse_actions(row) for row in rows]


def test_hand_written_table_is_a_valid_input():
    assert simulate(table(*GOOD_1F1B), 2).bubble_fraction == pytest.approx(closed_form(2, 2))


def test_validator_rejects_a_missing_backward():
    rank0 = GOOD_1F1B[0].replace(" B1.0", "")
    with pytest.raises(ScheduleError, match=r"rank 0, end of list \(position 7\): missing BACKWARD of "
                                            r"micro-batch 1, chunk 0"):
        simulate(table(rank0, GOOD_1F1B[1]), 2)


def test_validator_rejects_a_duplicated_forward():
    rank1 = GOOD_1F1B[1].replace("F1.0 B1.0", "F1.0 F1.0 B1.0")
    with pytest.raises(ScheduleError, match=r"rank 1, position 6 \(F1.0\): duplicated FORWARD of "
                                            r"micro-batch 1, chunk 0"):
        simulate(table(GOOD_1F1B[0], rank1), 2)


def test_validator_rejects_a_table_where_both_ranks_receive_first():
    deadlock = table("[rG0.0<1] F0.0 [sA0.0>1] B0.0", "[rA0.0<0] F0.0 B0.0 [sG0.0>0]")
    with pytest.raises(ScheduleError) as err:
        simulate(deadlock, 1)
    assert str(err.value) == (
        "deadlock: rank 0 waits forever at position 0 (rG0.0<1) for rank 1, whose matching op is at its "
        "position 3 (sG0.0>0); rank 1 waits forever at position 0 (rA0.0<0) for rank 0, whose matching op "
        "is at its position 2 (sA0.0>1)")


@pytest.mark.parametrize("shared", [(0.0, 1.0), (-0.5, 1.0), (float("nan"), 1.0)])
def test_a_sharing_that_is_not_a_positive_time_multiple_is_refused(shared):
    with pytest.raises(ValueError, match="each above 0"):
        Costs(shared=shared)


def test_a_deadlock_is_found_on_shared_cores_too():
    deadlock = table("[rG0.0<1] F0.0 [sA0.0>1] B0.0", "[rA0.0<0] F0.0 B0.0 [sG0.0>0]")
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits forever at position 0"):
        simulate(deadlock, 1, costs=Costs(shared=(0.5, 1.0)))


def test_validator_rejects_a_fifo_payload_mismatch():
    # Rank 1 posts its two receives from rank 0 in the opposite order to rank 0's sends: with no tags, the
    # first activation sent would land in the second micro-batch's buffer.
    swapped = table("F0.0 [sA0.0>1] F1.0 [sA1.0>1] [rG0.0<1] B0.0 [rG1.0<1] B1.0",
                    "[rA1.0<0 rA0.0<0] F0.0 F1.0 B0.0 [sG0.0>0] B1.0 [sG1.0>0]")
    with pytest.raises(ScheduleError, match=r"FIFO mismatch on channel 0->1: message #0 is sent as sA0.0>1 "
                                            r"\(rank 0, position 1\) but received as rA1.0<0 \(rank 1, "
                                            r"position 0\)"):
        simulate(swapped, 2)


@pytest.mark.parametrize(("rows", "why"), [
    (["F0.0 [sA0.0>0] B0.0", "[rA0.0<0] F0.0 B0.0"],
     r"rank 0, position 1 \(sA0.0>0\): peer should be rank 1"),
    (["[sA0.0>1] F0.0 B0.0", "[rA0.0<0] F0.0 B0.0"],
     r"rank 0, position 0 \(sA0.0>1\): sends before its FORWARD has produced the tensor"),
    (["F0.0 [sA0.0>1 rG0.0<1] B0.0", "F0.0 B0.0"],
     r"rank 1, position 0 \(F0.0\): its input is not on hand yet \(needs rA0.0<0 before it\)"),
    (["F0.0 B0.0 F1.0 B1.0"], r"micro-batch or chunk out of range"),
])
def test_validator_names_rank_position_and_action(rows, why):
    with pytest.raises(ScheduleError, match=why):
        simulate(table(*rows), 1)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 2)])
def test_2bw_runs_1f1b_within_a_step_and_without_the_flush_its_steady_state_has_no_bubble(pp, m):
    """PipeDream-2BW: a step's lists are 1F1B's; the next step's forwards start as its backwards drain, so two
    steps back to back cost one step more than one, m (F + B) a rank: no idle time left (1F1B pays (pp - 1) (F + B)
    each step)."""
    one = build_schedule("2bw", pp, m)
    assert one == build_schedule("1f1b", pp, m)
    for costs in (Costs(), Costs(1.0, 3.0, 0.0)):
        per_step, bubble = steady_state(one, build_schedule("2bw", pp, 2 * m), m, costs)
        flushed = simulate(build_schedule("1f1b", pp, m), m, costs=costs)
        assert per_step == m * (costs.forward + costs.backward) and bubble == 0.0
        assert flushed.makespan == (m + pp - 1) * (costs.forward + costs.backward) and flushed.bubble_fraction > 0


def test_2bw_is_refused_with_virtual_stages_and_the_plan_shows_its_steady_state():
    with pytest.raises(ScheduleError, match="2bw needs vpp=1"):
        check_schedule_args("2bw", 2, 4, 2)
    spec = tiny_spec(model={"n_layer": 4}, parallel={"pp": 4, "microbatches": 8, "schedule": "2bw"})
    shown = describe(make_plan(parse_spec(spec)))["schedule"]
    assert shown["flushes"] is False and shown["bubble_fraction"] == 0.0
    assert shown["makespan"] == 8 * 3.0  # a step in steady state, at the default costs (F 1, B 2)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"zero": 1}, "parallel.zero"), ({"dp": 2, "sync": {"kind": "local_sgd", "every": 2}}, "parallel.sync")])
def test_2bw_refuses_what_would_step_another_weight_version_naming_the_field(overrides, field):
    spec = tiny_spec(parallel={"dp": 2, "pp": 2, "microbatches": 2, "schedule": "2bw", **overrides})
    with pytest.raises(PlanError) as info:
        make_plan(parse_spec(spec))
    assert info.value.field == field and "PipeDream-2BW's two weight versions" in str(info.value)
