"""The plan's rank map, process groups, stage split and resources."""

import pytest
from helpers import tiny_spec

from api.spec import parse_spec
from parallel.plan import Plan, PlanError, RankCoords, _rank_grid, describe, make_plan, split_layers


def grid_plan(dp: int, pp: int, tp: int) -> Plan:
    """A plan with arbitrary degrees (make_plan still refuses tp > 1), to test the general rank map."""
    plan = make_plan(parse_spec(tiny_spec()))
    return Plan(**{**plan.__dict__, "dp": dp, "pp": pp, "tp": tp, "ranks": _rank_grid(pp, tp, dp)})


def test_rank_map_puts_tp_fastest_then_dp_then_pp():
    plan = grid_plan(dp=2, pp=2, tp=2)
    assert plan.world_size == 8
    assert plan.coords(0) == RankCoords(rank=0, pp=0, tp=0, dp=0)
    assert plan.coords(1) == RankCoords(rank=1, pp=0, tp=1, dp=0)
    assert plan.coords(2) == RankCoords(rank=2, pp=0, tp=0, dp=1)
    assert plan.coords(4) == RankCoords(rank=4, pp=1, tp=0, dp=0)
    assert all(plan.rank_of(c.pp, c.tp, c.dp) == c.rank for c in plan.ranks)


def test_groups_partition_the_world_along_each_axis():
    plan = grid_plan(dp=2, pp=2, tp=2)
    assert plan.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for groups in (plan.tp_groups(), plan.dp_groups(), plan.pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_worker_names_follow_the_architecture():
    plan = grid_plan(dp=2, pp=2, tp=2)
    assert plan.worker_name(5) == "pp1-tp1-dp0"


def test_one_bundle_per_tp_group():
    plan = grid_plan(dp=2, pp=1, tp=2)
    assert plan.bundles() == [{"CPU": 2.0}, {"CPU": 2.0}]


def test_data_parallel_plan_has_one_stage_with_every_layer():
    plan = make_plan(parse_spec(tiny_spec(parallel={"dp": 4}, global_batch=8)))
    assert plan.world_size == 4 and plan.micro_batch_size == 2
    assert plan.stage_layers == ((0, 1),)
    d = describe(plan)
    assert [r["name"] for r in d["ranks"]] == [f"pp0-tp0-dp{i}" for i in range(4)]
    assert d["resources"]["needed"] == {"CPU": 4.0, "GPU": 0.0}


def test_layers_split_evenly_with_extras_on_later_stages():
    config = parse_spec(tiny_spec(model={"n_layer": 7}, parallel={"pp": 3}))
    assert split_layers(config) == ((0, 1), (2, 3, 4), (5, 6))


def test_explicit_stage_layers_are_honoured_and_checked():
    config = parse_spec(tiny_spec(model={"n_layer": 6}, parallel={"pp": 2, "stage_layers": [1, 5]}))
    assert split_layers(config) == ((0,), (1, 2, 3, 4, 5))
    with pytest.raises(PlanError, match="sums to 5 but n_layer=6"):
        split_layers(parse_spec(tiny_spec(model={"n_layer": 6}, parallel={"pp": 2, "stage_layers": [1, 4]})))
    with pytest.raises(PlanError, match="has 3 entries but pp x vpp = 2"):
        split_layers(parse_spec(tiny_spec(model={"n_layer": 6}, parallel={"pp": 2, "stage_layers": [1, 4, 1]})))


def test_too_few_layers_for_the_stages_is_refused():
    with pytest.raises(PlanError, match="cannot be split into pp x vpp = 4 stages"):
        split_layers(parse_spec(tiny_spec(model={"n_layer": 2}, parallel={"pp": 4})))
