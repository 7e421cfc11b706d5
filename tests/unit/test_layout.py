"""A planner's questions without a Plan: the rules' violations, a layout from degrees, what it costs."""

import pickle
from dataclasses import replace

import pytest
from helpers import tiny_spec
from trainyard.parallel.plan import ClusterResources, Layout, NodeResources, PlanError, admission, make_plan, rules
from trainyard.parallel.plan.memory.estimate import estimate
from trainyard.parallel.spec import parse_spec


def test_the_rules_return_every_violation_and_make_plan_raises_the_first():
    config = parse_spec(tiny_spec(model={"n_head": 3, "d_model": 64}, parallel={"tp": 2, "dp": 2}, global_batch=3))
    found = rules.violations(config)
    assert [e.field for e in found] == ["model.n_head", "parallel.tp", "global_batch"]
    assert all(isinstance(e, PlanError) for e in found)
    with pytest.raises(PlanError) as raised:
        make_plan(config)
    assert (raised.value.field, raised.value.message) == (found[0].field, found[0].message)
    assert rules.violations(parse_spec(tiny_spec())) == []


def test_a_layout_built_from_degrees_costs_what_the_plan_of_the_same_layout_costs():
    config = parse_spec(tiny_spec(model={"n_layer": 4}, parallel={"dp": 2, "pp": 2, "microbatches": 2,
                                                                  "zero": 1}, global_batch=8))
    plan = make_plan(config)
    layout = Layout.build(dp=2, pp=2, tp=1, microbatches=2, micro_batch_size=2, layer_counts=[2, 2])
    assert layout == plan.layout and layout.worker_name(3) == "pp1-tp0-dp1"
    assert estimate(layout, config) == plan.memory()
    # the planner's next candidate: the same config over more pipeline stages, no plan built
    deeper = Layout.build(dp=1, pp=4, tp=1, microbatches=4, micro_batch_size=2, layer_counts=[1] * 4)
    assert max(m.params for m in estimate(deeper, config)) < max(m.params for m in plan.memory())


def test_admission_answers_from_a_layout_whether_a_cluster_holds_it():
    config = parse_spec(tiny_spec(parallel={"dp": 4}, global_batch=8))
    layout = make_plan(config).layout
    small = ClusterResources((NodeResources(cpus=2, gpus=0),))
    assert [e.field for e in admission.fit_violations(layout, small)] == ["parallel.dp"]
    assert admission.fit_violations(replace(layout, dp=2), small) == []
    tiny_memory = ClusterResources((NodeResources(cpus=8, gpus=0, memory=1024.0),))
    assert [e.field for e in admission.memory_violations(layout, config, tiny_memory)] == ["model"]


def test_a_plan_crosses_processes_whole():
    plan = make_plan(parse_spec(tiny_spec(parallel={"dp": 2, "tp": 2}, global_batch=8)))
    copy = pickle.loads(pickle.dumps(plan))  # Ray sends it to every worker
    assert copy == plan and copy.ranks == plan.ranks and copy.worker_name(3) == "pp0-tp1-dp1"
