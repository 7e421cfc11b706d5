"""The plan's rank map, process groups, stage split and resources."""

from dataclasses import replace

import pytest
from helpers import tiny_spec
from trainyard.parallel.plan import (
    ClusterResources,
    NodeResources,
    Plan,
    PlanError,
    RankCoords,
    make_plan,
    split_layers,
)
from trainyard.parallel.plan.present import describe
from trainyard.parallel.spec import parse_spec


def grid_plan(dp: int, pp: int, tp: int) -> Plan:
    """A plan with arbitrary degrees, to test the general rank map apart from make_plan's rules."""
    plan = make_plan(parse_spec(tiny_spec()))
    return replace(plan, layout=replace(plan.layout, dp=dp, pp=pp, tp=tp))


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


def test_layers_split_evenly_with_extras_on_middle_stages_first():
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


def pipeline_plan(**parallel) -> Plan:
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 8}, global_batch=16, parallel=parallel)))


def test_each_pipeline_rank_gets_its_own_action_list():
    plan = pipeline_plan(pp=4, microbatches=8, schedule="1f1b")
    assert len(plan.actions) == 4 and plan.schedule.name == "1f1b"
    first, last = plan.actions[0], plan.actions[-1]
    assert str(first[0]) == "F0.0" and str(first[1]) == "sA0.0>1"
    assert [str(a) for a in (last[0], last[-2], last[-1])] == ["rA0.0<2", "B7.0", "sG7.0>2"]


@pytest.mark.parametrize(("parallel", "bubble", "peaks"), [
    ({"pp": 4, "microbatches": 8, "schedule": "gpipe"}, 3 / 11, [8, 8, 8, 8]),
    ({"pp": 4, "microbatches": 8, "schedule": "1f1b"}, 3 / 11, [4, 3, 2, 1]),
    ({"pp": 4, "vpp": 2, "microbatches": 8, "schedule": "interleaved-1f1b"}, 3 / 19, [11, 9, 7, 5]),
    ({"pp": 1, "microbatches": 4}, 0.0, [1]),
    # zero-bubble (F 1, I 1, W 1): ZB-H1's bubble is pp - 1 time units at 1F1B's peak memory
    ({"pp": 4, "microbatches": 8, "schedule": "zb-h1"}, 3 / 27, [4, 4, 4, 4]),
    ({"pp": 4, "vpp": 2, "microbatches": 8, "schedule": "zbv"}, 3 / 51, [8, 8, 8, 8]),
], ids=["gpipe", "1f1b", "interleaved", "no-pipeline", "zb-h1", "zbv"])
def test_described_plan_shows_the_simulated_schedule(parallel, bubble, peaks):
    schedule = describe(pipeline_plan(**parallel))["schedule"]
    assert schedule["kind"] == parallel.get("schedule", "1f1b")
    assert schedule["bubble_fraction"] == pytest.approx(bubble)
    assert schedule["peak_activations"] == peaks
    assert len(schedule["stages"]) == parallel["pp"] == len(schedule["gantt"].splitlines()) - 1
    assert schedule["placement"] == ("v" if parallel.get("schedule") == "zbv" else "interleaved")
    split = {"backward_weight": 1.0} if parallel.get("schedule", "").startswith("zb") else {}
    assert schedule["costs"] == {"forward": 1.0, "backward": 2.0, "comm": 0.0, **split}


def test_simulation_costs_come_from_the_spec():
    spec = tiny_spec(model={"n_layer": 8}, global_batch=16, parallel={"pp": 2, "microbatches": 2},
                     sim_costs={"forward": 2, "backward": 3, "comm": 1})
    schedule = describe(make_plan(parse_spec(spec)))["schedule"]
    # 1f1b, pp=2, m=2, with a comm run between each dependent pair: F F B B on the critical path, plus comms.
    assert schedule["makespan"] > (2 + 2) * 2 + 2 * 3  # slower than the free-communication figure


@pytest.mark.parametrize(("parallel", "rule"), [
    ({"pp": 2, "vpp": 2, "microbatches": 4, "schedule": "1f1b"}, "1f1b needs vpp=1"),
    ({"pp": 2, "vpp": 1, "microbatches": 4, "schedule": "interleaved-1f1b"}, "interleaved-1f1b needs vpp >= 2"),
    ({"pp": 4, "vpp": 2, "microbatches": 2, "schedule": "interleaved-1f1b"}, "needs microbatches >= pp"),
    ({"pp": 1, "vpp": 2, "microbatches": 2, "schedule": "interleaved-1f1b"}, "needs pp >= 2"),
    ({"pp": 2, "vpp": 1, "microbatches": 4, "schedule": "zbv"}, "zbv needs vpp=2"),
    ({"pp": 2, "vpp": 2, "microbatches": 4, "schedule": "zb-h1"}, "zb-h1 needs vpp=1"),
])
def test_schedules_a_kind_cannot_run_are_refused_naming_the_rule(parallel, rule):
    with pytest.raises(PlanError, match=rule) as err:
        pipeline_plan(**parallel)
    assert err.value.field == "parallel.schedule"


def test_a_weight_gradient_cost_above_the_whole_backward_is_refused():
    spec = tiny_spec(parallel={"pp": 2, "microbatches": 2, "schedule": "zb-h1"},
                     sim_costs={"backward": 2, "backward_weight": 3})
    with pytest.raises(PlanError, match="backward_weight=3.0 exceeds backward=2.0") as err:
        make_plan(parse_spec(spec))
    assert err.value.field == "sim_costs.backward_weight"


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_bubble_schedules_plan_with_zero2_and_zero3_and_with_compile_but_not_full_recompute(zero):
    """FSDP2 follows the split backward (`parallel.runtime.dp.fsdp_split`); compiled blocks keep their linears eager
    under it, so each half runs only its own matmuls (`parallel.runtime.compile`), which full recompute's
    whole-block checkpoint cannot span."""
    zb = {"pp": 2, "dp": 2, "microbatches": 2, "schedule": "zb-h1", "zero": zero}
    assert make_plan(parse_spec(tiny_spec(parallel=zb))).config.parallel.zero == zero
    plan = make_plan(parse_spec(tiny_spec(parallel=zb, compile=True, activation_checkpointing="selective")))
    assert plan.config.compile and plan.config.parallel.schedule == "zb-h1"
    # a whole block's checkpoint cannot span the eager linears
    with pytest.raises(PlanError, match="torch cannot checkpoint a whole block across them") as err:
        make_plan(parse_spec(tiny_spec(parallel=zb, compile=True, activation_checkpointing="full")))
    assert err.value.field == "activation_checkpointing"
    assert make_plan(parse_spec(tiny_spec(parallel={**zb, "schedule": "1f1b"}, compile=True,
                                          activation_checkpointing="full"))).config.compile


@pytest.mark.parametrize("parallel", [{"pp": 2}, {"pp": 2, "vpp": 2, "microbatches": 2, "schedule": "zbv"}])
def test_tied_embeddings_plan_at_any_pp(parallel):
    plan = make_plan(parse_spec(tiny_spec(model={"n_layer": 4, "tie_embeddings": True}, parallel=parallel)))
    # the first and the last virtual stage on two ranks sum the two copies' gradients; zbv's rank 0 holds both
    assert plan.tied_groups() == ([[0, 1]] if parallel.get("schedule") != "zbv" else [])


def test_tied_embeddings_across_stages_plan_with_replica_sync():
    spec = tiny_spec(model={"tie_embeddings": True}, parallel={"pp": 2, "dp": 2, "sync": {"kind": "local_sgd"}})
    assert make_plan(parse_spec(spec)).tied_groups() == [[0, 2], [1, 3]]


def tp_plan(cluster: ClusterResources | None = None, model: dict | None = None, **parallel) -> Plan:
    spec = tiny_spec(model={"n_head": 4, "d_model": 32, "vocab_size": 256, "seq_len": 16, **(model or {})},
                     parallel=parallel)
    return make_plan(parse_spec(spec), cluster)


def test_tensor_and_sequence_parallel_plans_are_accepted_and_describe_their_tp_groups():
    plan = tp_plan(dp=2, pp=2, tp=2, sp=True, microbatches=2)
    assert plan.world_size == 8 and plan.tp == 2
    assert describe(plan)["groups"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert describe(plan)["degrees"]["tp"] == 2


def plan_error(model: dict | None = None, cluster: ClusterResources | None = None, **parallel) -> PlanError:
    with pytest.raises(PlanError) as err:
        tp_plan(cluster, model, **parallel)
    return err.value


def test_plan_rejects_tp_not_dividing_heads():
    err = plan_error(tp=3)
    assert err.field == "parallel.tp" and "tp=3 does not divide n_head=4" in err.message


def test_plan_rejects_tp_not_dividing_the_vocabulary():
    err = plan_error({"n_head": 6, "d_model": 48, "vocab_size": 257}, tp=3)
    assert err.field == "parallel.tp" and "tp=3 does not divide vocab_size=257" in err.message


def test_plan_rejects_sp_without_tp():
    err = plan_error(sp=True)
    assert err.field == "parallel.sp" and "sp=true needs tp > 1" in err.message


def test_plan_rejects_sp_when_tp_does_not_divide_seq_len():
    err = plan_error({"n_head": 6, "d_model": 48, "vocab_size": 258}, tp=3, sp=True)
    assert err.field == "parallel.sp" and "tp=3 does not divide seq_len=16" in err.message
    assert tp_plan(model={"n_head": 6, "d_model": 48, "vocab_size": 258, "seq_len": 18}, tp=3, sp=True).tp == 3


def test_plan_counts_dp_x_pp_x_tp_workers_against_the_cluster():
    two_nodes = ClusterResources(nodes=(NodeResources(cpus=2, gpus=0), NodeResources(cpus=2, gpus=0)))
    assert tp_plan(two_nodes, dp=2, tp=2).world_size == 4
    err = plan_error(None, two_nodes, dp=2, pp=2, tp=2)
    assert "needs 8 workers" in err.message and "dp=2 x pp=2 x tp=2" in err.message
    # A tensor-parallel group is one bundle, on one node: tp=4 needs a node with 4 CPUs.
    err = plan_error(None, two_nodes, tp=4)
    assert "can ever hold only 0" in err.message


def test_expert_parallel_groups_are_carved_out_of_dp_and_ranks_name_their_experts():
    spec = tiny_spec(model={"n_layer": 2, "moe": {"experts": 8, "every": 1}}, global_batch=8,
                     parallel={"dp": 4, "ep": 2, "tp": 2, "pp": 1})
    plan = make_plan(parse_spec({**spec, "model": {**spec["model"], "n_head": 2}}))
    # dp coordinate d has ep index d % 2: ranks (tp=0, dp=0..3) are 0, 2, 4, 6
    assert plan.ep_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert list(plan.experts_of(2)) == [4, 5, 6, 7] and list(plan.experts_of(4)) == [0, 1, 2, 3]
    # the same experts: every dp replica and both tp ranks
    assert plan.expert_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert plan.stage_groups() == [list(range(8))]
    assert plan.worker_name(3) == "pp0-tp1-dp1-experts4-7"
    described = describe(plan)
    assert described["ranks"][3]["experts"] == [4, 5, 6, 7] and described["ranks"][3]["ep"] == 1
    assert described["moe_blocks"] == [0, 1]


def test_dense_and_ep1_worker_names_are_unchanged():
    plan = make_plan(parse_spec(tiny_spec(model={"moe": {"experts": 4}}, parallel={"dp": 2})))
    assert plan.worker_name(1) == "pp0-tp0-dp1" and list(plan.experts_of(1)) == [0, 1, 2, 3]
