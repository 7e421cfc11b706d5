"""The reduction sets have one home (`parallel.plan.reduction_sets`): the groups that sum each set's gradients, their
sizes (what the memory plan shards over and the reduction bytes count) and the runtime's groups agree."""

import pytest
from helpers import tiny_spec
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.present import describe
from trainyard.parallel.plan.reduction_sets import REDUCTION_SETS, group_sizes, reduction_groups, shared_sets
from trainyard.parallel.spec import parse_spec

MOE = {"n_layer": 2, "moe": {"experts": 4, "every": 1}}


@pytest.mark.parametrize("spec", [
    tiny_spec(parallel={"dp": 4}),
    tiny_spec(parallel={"dp": 2, "tp": 2, "pp": 2}),
    tiny_spec(model=MOE, parallel={"dp": 4, "ep": 2, "tp": 2}),
    tiny_spec(model=MOE, parallel={"dp": 4, "ep": 2, "sync": {"kind": "local_sgd", "every": 2, "replicas": 2}}),
    tiny_spec(parallel={"dp": 4, "sync": {"kind": "diloco", "every": 2}}),
])
def test_each_sets_groups_cover_every_rank_once_at_the_size_the_plan_counts(spec):
    plan = make_plan(parse_spec(spec))
    groups, sizes = reduction_groups(plan.layout), group_sizes(plan.layout)
    assert tuple(groups) == tuple(sizes) == REDUCTION_SETS
    for name, lists in groups.items():
        assert sorted(r for g in lists for r in g) == list(range(plan.world_size)), name
        assert {len(g) for g in lists} == {sizes[name]}, name
    assert groups["dense"] == plan.dp_groups() and groups["router"] == plan.stage_groups()


def test_replicas_that_step_apart_send_no_gradients_between_them():
    """local_sgd with one dp rank per replica sums no gradient every step (its replicas average parameters at the
    syncs, `describe`'s `sync`): the plan's reduction says none, as the ranks' `reduce_bytes` measure."""
    plan = make_plan(parse_spec(tiny_spec(parallel={"dp": 4, "sync": {"kind": "local_sgd", "every": 2}})))
    assert shared_sets(plan.layout) == set() and plan.reduce_dp == 1
    assert all(s["uncompressed"] == s["sent"] == 0 for s in describe(plan)["reduction"]["per_stage"])
    two = make_plan(parse_spec(tiny_spec(parallel={"dp": 4, "sync": {"kind": "local_sgd", "every": 2,
                                                                     "replicas": 2}})))
    assert shared_sets(two.layout) == {"dense", "router", "experts"} and group_sizes(two.layout)["dense"] == 2
