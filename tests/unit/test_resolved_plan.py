"""A plan carries each strategy its config names, looked up once when it is made (`parallel.plan.sizing.Resolved`):
the sharding, the pipeline schedule (and its action lists apart), the optimizer, the model family, and the layout
written out. Made again from its inputs wherever it goes (replace, pickle), so they never disagree with the config."""

import ast
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import tiny_spec
from trainyard.parallel.config import RuleError
from trainyard.parallel.models import FAMILIES
from trainyard.parallel.optim.kinds import OPTIMIZERS
from trainyard.parallel.plan import make_plan, resize_plan
from trainyard.parallel.plan.schedule.schedules import SCHEDULES
from trainyard.parallel.plan.sharding import SHARDINGS
from trainyard.parallel.plan.sizing import Resolved, Sizing
from trainyard.parallel.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = tiny_spec(model={"family": "llama", "n_layer": 4}, optimizer={"kind": "sgd"},
                 parallel={"dp": 2, "pp": 2, "microbatches": 2, "schedule": "zb-h1", "zero": 1})


def test_the_plan_carries_each_strategy_its_config_names():
    plan = make_plan(parse_spec(SPEC))
    assert plan.parallel is plan.config.parallel and plan.parallel.dp == 2
    assert plan.sharding is SHARDINGS[1] and plan.schedule is SCHEDULES["zb-h1"]
    assert plan.optimizer is OPTIMIZERS["sgd"] and plan.family is FAMILIES["llama"]
    assert plan.actions == plan.layout.actions and len(plan.actions) == 2  # the kind's action lists, per pp rank
    assert plan.schedule.splits_backward and plan.schedule.placement == plan.placement == "interleaved"


def test_an_elastic_plan_carries_its_current_size_written_out():
    plan = make_plan(parse_spec(tiny_spec(parallel={"dp": {"min": 1, "max": 4}})))
    assert plan.dp_range == (1, 4) and plan.parallel.dp == 1 == plan.dp
    bigger = resize_plan(plan, 2)
    assert bigger.parallel.dp == 2 and bigger.dp_range == (1, 4) and bigger.sharding is plan.sharding


def test_a_changed_config_is_resolved_again():
    plan = make_plan(parse_spec(SPEC))
    other = replace(plan, config=replace(plan.config, parallel=replace(plan.parallel, zero=0)))
    assert other.sharding is SHARDINGS[0] and other.parallel.zero == 0


def test_a_plan_pickles_as_its_inputs_and_finds_the_same_entries():
    """The registries' entries hold functions (plain pickle refuses lambdas): a plan travels as its config and
    layout, to a rank spawned by multiprocessing or a Ray actor, and looks its entries up there."""
    plan = make_plan(parse_spec(SPEC))
    back = pickle.loads(pickle.dumps(plan))
    assert back == plan and type(back) is type(plan) and back.dp_range == plan.dp_range
    assert back.sharding is plan.sharding and back.optimizer is plan.optimizer and back.schedule is plan.schedule


def test_a_sizing_reads_like_its_layout_with_the_same_entries():
    plan = make_plan(parse_spec(SPEC))
    sizing = Sizing(plan.config, layout=plan.layout)
    assert sizing.tp == plan.tp and sizing.actions == plan.actions and sizing.family is plan.family


def test_a_name_no_registry_holds_or_an_auto_layout_is_a_rule_error_naming_the_field():
    config = parse_spec(SPEC)
    with pytest.raises(RuleError) as err:
        Resolved(replace(config, optimizer=replace(config.optimizer, kind="lion")))  # type: ignore[arg-type]
    assert err.value.field == "optimizer.kind" and "'adamw', 'adamw8bit'" in err.value.message
    with pytest.raises(RuleError) as err:
        Resolved(replace(config, parallel="auto"))
    assert err.value.field == "parallel" and "resolved by the planner" in err.value.message


def test_nothing_outside_the_plan_room_reads_the_layout_back_out_of_a_config():
    """A job carries its layout written out from the plan on (`plan.parallel`): only `parallel/plan`, which makes
    plans from configs, reads it out of a config (`parallel.plan.sizing.fixed_parallel`)."""
    readers = []
    for top in ("api", "service", "actors", "parallel", "cli", "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.is_relative_to(ROOT / "parallel" / "plan"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                named = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) \
                    else node.name if isinstance(node, ast.alias) else None
                if named == "fixed_parallel":
                    readers.append(f"{path.relative_to(ROOT)}:{node.lineno if hasattr(node, 'lineno') else '?'}")
    assert readers == []
