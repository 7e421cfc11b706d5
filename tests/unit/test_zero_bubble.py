"""Zero-bubble schedules (zb-h1, zbv) against torch's own: same costs, our bubble no worse, peaks no higher.

torch builds each rank's order as data (`_calculate_single_rank_operations`) before it runs anything; the
test calls that on schedule objects made without stages (only the attributes the order needs), turns the
orders into ours (its stage index -> our rank and local chunk), places the messages the same way ours are
placed, and runs both through our simulator under forward 1, input-backward 1, weight-backward 1.
"""

import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from trainyard.parallel.plan.schedule.actions import ActionKind, ScheduleError, stage_location, virtual_stage
from trainyard.parallel.plan.schedule.schedule_sim import simulate
from trainyard.parallel.plan.schedule.schedule_timing import Costs
from trainyard.parallel.plan.schedule.schedules import build_schedule, place_comm, placement_of

UNIT = Costs(forward=1.0, backward=2.0, backward_weight=1.0)  # F 1, I 1, W 1
KINDS = {"F": ActionKind.FORWARD, "I": ActionKind.BACKWARD_INPUT, "W": ActionKind.BACKWARD_WEIGHT,
         "B": ActionKind.BACKWARD}


def torch_interleaved_zero_bubble(pp: int, m: int) -> list[list[tuple]]:
    """torch's ScheduleInterleavedZeroBubble order with one chunk per rank (ZB-H1), bubbles included."""
    s = object.__new__(torch_schedules.ScheduleInterleavedZeroBubble)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = pp, 1, m
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    if m % s.number_of_rounds:
        pytest.skip(f"torch refuses m={m} with pp={pp}")
    s.pipeline_order = {rank: s._calculate_single_rank_operations(rank) for rank in range(pp)}
    return s._add_bubbles_to_actions(pp).values()


def torch_zbv(pp: int, m: int) -> list[list[tuple]]:
    s = object.__new__(torch_schedules.ScheduleZBVZeroBubble)
    s.pp_group_size, s.num_stages, s._n_microbatches = pp, 2 * pp, m
    return [s._calculate_single_rank_operations(rank) for rank in range(pp)]


def as_ours(torch_order, pp: int, vpp: int, placement: str):
    """torch's per-rank actions (stage, type, micro-batch) as our per-rank lists, messages placed as ours."""
    orders = []
    for rank, actions in enumerate(torch_order):
        order = []
        for a in actions:
            if a is None:
                continue
            holder, chunk = stage_location(a.stage_index, pp, placement)
            assert holder == rank
            order.append((KINDS[a.computation_type.value], a.microbatch_index, chunk))
        orders.append(order)
    return place_comm(orders, pp, vpp, placement)


CASES = [(pp, m) for pp in (2, 4) for m in (4, 8)] + [(2, 6), (4, 6), (4, 5)]


@pytest.mark.parametrize("pp, m", CASES)
def test_zb_h1_bubble_and_memory_no_worse_than_torchs_zero_bubble(pp, m):
    ours = simulate(build_schedule("zb-h1", pp, m), m, 1, UNIT)
    theirs = simulate(as_ours(torch_interleaved_zero_bubble(pp, m), pp, 1, "interleaved"), m, 1, UNIT)
    assert ours.bubble_fraction <= theirs.bubble_fraction + 1e-12
    assert max(ours.peak_activations) <= max(theirs.peak_activations)
    one_f_one_b = simulate(build_schedule("1f1b", pp, m), m, 1, UNIT)
    assert max(ours.peak_activations) == max(one_f_one_b.peak_activations) == min(pp, m)  # 1F1B's memory
    assert ours.bubble_fraction < one_f_one_b.bubble_fraction / 2  # bubble well below it


@pytest.mark.parametrize("pp, m", CASES)
def test_zbv_bubble_and_memory_no_worse_than_torchs_zbv(pp, m):
    ours = simulate(build_schedule("zbv", pp, m, vpp=2), m, 2, UNIT, placement="v")
    theirs = simulate(as_ours(torch_zbv(pp, m), pp, 2, "v"), m, 2, UNIT, placement="v")
    assert ours.bubble_fraction <= theirs.bubble_fraction + 1e-12
    assert max(ours.peak_activations) <= max(theirs.peak_activations)


def test_zb_h1_bubble_is_the_papers_closed_form():
    # Qi et al.: with F = I = W the ZB-H1 bubble is (pp - 1) time units, against 1F1B's 3 (pp - 1).
    for pp, m in [(2, 4), (4, 8), (8, 16)]:
        assert simulate(build_schedule("zb-h1", pp, m), m, 1, UNIT).makespan == 3 * m + pp - 1


def test_v_placement_runs_down_the_ranks_and_back():
    assert [stage_location(v, 4, "v") for v in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1),
                                                            (1, 1), (0, 1)]
    assert all(virtual_stage(*stage_location(v, 3, "v"), 3, "v") == v for v in range(12))
    assert placement_of("zbv") == "v" and placement_of("zb-h1") == "interleaved"
    # one rank: both placements are the same, so a single-rank run is the same model either way
    assert [virtual_stage(0, c, 1, "v") for c in range(2)] == [virtual_stage(0, c, 1) for c in range(2)]


def test_zero_bubble_kinds_refuse_the_wrong_number_of_chunks():
    with pytest.raises(ScheduleError, match="zbv needs vpp=2"):
        build_schedule("zbv", 2, 4, vpp=1)
    with pytest.raises(ScheduleError, match="zb-h1 needs vpp=1"):
        build_schedule("zb-h1", 2, 4, vpp=2)


def test_the_weight_half_can_wait_but_not_run_before_the_input_half():
    stages = build_schedule("zb-h1", 2, 2)
    broken = [list(stages[0]), list(stages[1])]
    i = next(k for k, a in enumerate(broken[1]) if a.kind is ActionKind.BACKWARD_INPUT)
    w = next(k for k, a in enumerate(broken[1]) if a.kind is ActionKind.BACKWARD_WEIGHT
             and a.microbatch == broken[1][i].microbatch)
    broken[1][i], broken[1][w] = broken[1][w], broken[1][i]
    with pytest.raises(ScheduleError, match="BACKWARD_WEIGHT before its BACKWARD_INPUT"):
        simulate(broken, 2)
