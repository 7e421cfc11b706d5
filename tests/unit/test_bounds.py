"""Every number a request carries is bounded, and every rule that refuses a spec runs before anything that
grows with its sizes is built: any spec is answered at once, with the field and the rule."""

import math

import pytest
from helpers import tiny_spec
from trainyard.parallel.plan import ClusterResources, NodeResources, PlanError, make_plan
from trainyard.parallel.spec import SpecError, parse_spec

LAPTOP = ClusterResources(nodes=(NodeResources(cpus=8, gpus=0, memory=16 * 2**30),))


@pytest.mark.parametrize("overrides,field,text", [
    ({"steps": 10**30}, "steps", "less than or equal to 1000000000"),
    ({"steps": 2**63}, "steps", "less than or equal to 1000000000"),
    ({"global_batch": 10**18}, "global_batch", "less than or equal to 16777216"),
    ({"seed": 2**63}, "seed", "less than or equal to 9223372036854775807"),
    ({"parallel": {"dp": 2**62}}, "parallel.dp", "less than or equal to 65536"),
    ({"fault": {"step_timeout_s": math.inf}}, "fault.step_timeout_s", "finite number"),
    ({"fault": {"step_timeout_s": 1e300}}, "fault.step_timeout_s", "less than or equal to 604800"),
    ({"sim_costs": {"forward": 1e308}}, "sim_costs.forward", "less than or equal to 1000000"),
    ({"sim_costs": {"comm": math.nan}}, "sim_costs.comm", "finite number"),
    ({"optimizer": {"lr": math.inf}}, "optimizer.lr", "finite number"),
    ({"priority": 10**7}, "priority", "less than or equal to 1000000"),
    ({"model": {"vocab_size": 2**33}}, "model.vocab_size", "less than or equal to 4294967296"),
])
def test_out_of_range_numbers_are_refused_naming_the_field_and_the_bound(overrides, field, text):
    with pytest.raises(SpecError) as info:
        parse_spec(tiny_spec(**overrides))
    assert any(f == field and text in m for f, m in info.value.errors), info.value.errors


def test_a_huge_layout_is_refused_by_the_cluster_fit_before_any_rank_list_is_built():
    spec = parse_spec(tiny_spec(parallel={"dp": 2**16}, global_batch=2**16))
    with pytest.raises(PlanError) as info:
        make_plan(spec, LAPTOP)
    assert info.value.field == "parallel.dp" and "needs 65536 workers" in info.value.message


def test_more_workers_than_any_job_may_have_is_refused_without_a_cluster():
    spec = parse_spec(tiny_spec(parallel={"dp": 2**16, "pp": 2}, global_batch=2**16))
    with pytest.raises(PlanError) as info:
        make_plan(spec)
    assert info.value.field == "parallel.dp" and "at most 65536" in info.value.message


def test_a_schedule_too_long_to_build_is_refused():
    spec = parse_spec(tiny_spec(parallel={"microbatches": 2**16}, global_batch=2**16))
    with pytest.raises(PlanError) as info:
        make_plan(spec)
    assert info.value.field == "parallel.microbatches" and "at most 32768" in info.value.message


def test_a_global_batch_no_rank_could_ever_hold_is_refused_at_submit():
    spec = parse_spec(tiny_spec(global_batch=2**24, model={"seq_len": 2048, "d_model": 256, "n_head": 2}))
    with pytest.raises(PlanError) as info:
        make_plan(spec, LAPTOP)
    assert info.value.field == "global_batch" and "(Ray's `memory` resource: 16 GiB" in info.value.message
    assert "activations" in info.value.message and "activation_checkpointing: full" in info.value.message


def test_a_model_no_node_could_hold_is_refused():
    spec = parse_spec(tiny_spec(model={"d_model": 2**17, "n_head": 2, "n_layer": 4}))
    with pytest.raises(PlanError) as info:
        make_plan(spec, LAPTOP)
    assert info.value.field == "model" and "(params 3,072.3, grads 3,072.3, optimizer 6,144.6" in info.value.message


def test_a_spec_at_every_bound_that_fits_is_planned():
    spec = parse_spec(tiny_spec(steps=10**9, seed=2**63 - 1, priority=-10**6,
                                fault={"step_timeout_s": 7 * 24 * 3600}))
    assert make_plan(spec, LAPTOP).world_size == 1
