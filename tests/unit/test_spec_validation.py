"""Every JobSpec rule, checked without a server: pydantic field rules and the plan's cross-field rules."""

import pytest
from helpers import REPO, tiny_spec
from trainyard.api.spec import parse_submitted_spec
from trainyard.parallel.data.datasets import DatasetError, open_dataset
from trainyard.parallel.plan import ClusterResources, NodeResources, PlanError, make_plan
from trainyard.parallel.spec import SPEC_ADAPTER, SpecError, load_spec_text, parse_spec

ARCHITECTURE_EXAMPLE = """
name: tiny-3d
seed: 1234
model: {n_layer: 4, n_head: 4, d_model: 64, vocab_size: 256, seq_len: 32,
        moe: {experts: 4, top_k: 2, every: 2, capacity_factor: 1.25, aux_loss_coef: 0.01}}
data: {kind: text, path: examples/corpus.txt}
optimizer: {lr: 3.0e-3, weight_decay: 0.1, warmup_steps: 10, grad_clip: 1.0}
steps: 200
global_batch: 16
precision: fp32
parallel: {dp: 2, pp: 2, tp: 2, ep: 1, vpp: 1, sp: false, microbatches: 4, schedule: 1f1b}
checkpoint: {every: 50, keep: 3, path: null}
fault: {max_failures: 3, step_timeout_s: 300}
resources: {gpus_per_worker: auto}
"""


def spec_error(spec: dict) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    return info.value.errors


def plan_error(spec: dict, cluster: ClusterResources | None = None) -> PlanError:
    with pytest.raises(PlanError) as info:
        make_plan(parse_spec(spec), cluster)
    return info.value


def test_every_field_of_the_architecture_example_parses():
    config = parse_spec(load_spec_text(ARCHITECTURE_EXAMPLE))
    assert config.parallel.tp == 2 and config.model.moe.experts == 4 and config.checkpoint.every == 50


def test_only_model_size_and_steps_are_required():
    errors = spec_error({})
    assert {f for f, _ in errors} == {"model", "steps"}
    config = parse_spec({"model": {"n_layer": 1, "n_head": 1, "d_model": 8}, "steps": 1})
    assert config.parallel.dp == config.parallel.pp == config.parallel.tp == config.parallel.ep == 1
    assert config.fault.max_failures == 3  # a job without a fault section survives a few failures


def test_unknown_field_is_named():
    assert ("optimizer.momentum", "unknown field 'momentum'") in spec_error(tiny_spec(optimizer={"momentum": 0.9}))


@pytest.mark.parametrize("name", ["two\nlines", "bell\a", "\x1b[31mred", "nul\x00"])
def test_a_name_with_control_characters_is_refused(name):
    """They would print as such (a new line, a colour) in `trainyard list`; any other unicode is a name."""
    with pytest.raises(SpecError) as info:
        parse_submitted_spec(tiny_spec(name=name))
    [(field, message)] = info.value.errors
    assert field == "name" and "control character" in message
    assert parse_submitted_spec(tiny_spec(name="données 日本 🚂")).name == "données 日本 🚂"
    assert parse_spec(tiny_spec(name=name)).name == name  # a stored spec from before the rule still loads


def test_wrong_type_is_named():
    errors = spec_error(tiny_spec(steps="many"))
    assert errors[0][0] == "steps" and "integer" in errors[0][1]


def number_fields(schema: dict, defs: dict, path: tuple = ()) -> set[tuple]:
    """The path of every field of the JobSpec's JSON schema that takes a number (a list's item as index 0)."""
    found = {path} if schema.get("type") in ("integer", "number") else set()
    if "$ref" in schema:
        found |= number_fields(defs[schema["$ref"].rpartition("/")[2]], defs, path)
    for option in schema.get("anyOf", []):
        found |= number_fields(option, defs, path)
    for name, field in schema.get("properties", {}).items():
        found |= number_fields(field, defs, (*path, name))
    if "items" in schema:
        found |= number_fields(schema["items"], defs, (*path, 0))
    return found


def with_value_at(spec: dict, path: tuple, value: object) -> dict:
    """`spec` with `value` at `path`, the sections on the way made (a list of one for an index)."""
    node = spec
    for key, child in zip(path, path[1:], strict=False):
        if isinstance(node, dict) and not isinstance(node.get(key), dict | list):
            node[key] = [{}] if isinstance(child, int) else {}
        node = node[key]
    node[path[-1]] = value
    return spec


SCHEMA = SPEC_ADAPTER.json_schema()
NUMBER_FIELDS = sorted(number_fields(SCHEMA, SCHEMA["$defs"]), key=str)


def test_the_walk_finds_the_number_fields_of_every_section():
    assert {("steps",), ("optimizer", "lr"), ("parallel", "dp"), ("parallel", "dp", "min"), ("parallel", "zero"),
            ("parallel", "stage_layers", 0), ("data", "sources", 0, "weight"), ("resources", "gpus_per_worker"),
            ("model", "moe", "capacity_factor"), ("sim_costs", "backward_weight")} <= set(NUMBER_FIELDS)
    assert len(NUMBER_FIELDS) > 50


@pytest.mark.parametrize("path", NUMBER_FIELDS, ids=lambda p: ".".join(map(str, p)))
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_for_a_number_is_refused_naming_the_field(path, value):
    """pydantic's lax mode read true as 1 and false as 0 (`steps: true` was one step, `parallel.zero: true` ZeRO-1,
    YAML's `yes` and `off` too)."""
    errors = spec_error(with_value_at(tiny_spec(), path, value))
    field = ".".join(map(str, path))
    assert any(f == field and m.endswith(", not a boolean") for f, m in errors), errors


def test_a_number_written_as_a_string_is_still_read():
    """PyYAML reads YAML 1.1, where `3e-4` and `1.0e3` (no dot, or no exponent sign) are strings: a spec file's
    `lr: 3e-4` reaches the API as the string "3e-4"."""
    spec = load_spec_text("model: {n_layer: 1, n_head: 1, d_model: 8}\nsteps: 10\n"
                          "optimizer: {lr: 3e-4, grad_clip: 1.0e3}")
    assert spec["optimizer"] == {"lr": "3e-4", "grad_clip": "1.0e3"}
    config = parse_spec({**spec, "steps": "10"})
    assert (config.steps, config.optimizer.lr, config.optimizer.grad_clip) == (10, 3e-4, 1000.0)


@pytest.mark.parametrize("field,spec", [
    ("steps", tiny_spec(steps=0)),
    ("global_batch", tiny_spec(global_batch=-8)),
    ("parallel.dp", tiny_spec(parallel={"dp": 0})),
    ("model.d_model", tiny_spec(model={"d_model": 0})),
    ("optimizer.lr", tiny_spec(optimizer={"lr": 0.0})),
])
def test_non_positive_sizes_are_refused(field, spec):
    assert field in [f for f, _ in spec_error(spec)]


def test_unknown_schedule_kind_is_refused():
    assert "parallel.schedule" in [f for f, _ in spec_error(tiny_spec(parallel={"schedule": "zero-bubble"}))]


def test_unknown_optimizer_kind_is_refused():
    assert "optimizer.kind" in [f for f, _ in spec_error(tiny_spec(optimizer={"kind": "lion"}))]


@pytest.mark.parametrize("field,optimizer", [
    ("optimizer.beta1", {"beta1": 1}), ("optimizer.beta2", {"beta2": 1}),
    ("optimizer.beta2", {"beta2": 1.0, "kind": "adamw8bit"}),
])
def test_adamw_betas_of_1_are_refused_naming_the_field(field, optimizer):
    err = plan_error(tiny_spec(optimizer=optimizer))
    assert err.field == field and "must be below 1" in err.message


def test_global_batch_must_divide_by_dp_times_microbatches():
    err = plan_error(tiny_spec(global_batch=10, parallel={"dp": 2, "microbatches": 2}))
    assert err.field == "global_batch" and "not divisible by dp x microbatches = 2 x 2 = 4" in err.message


def test_seq_len_beyond_model_context_is_refused():
    err = plan_error(tiny_spec(model={"seq_len": 64, "context_len": 32}))
    assert err.field == "model.seq_len" and "exceeds the model context" in err.message


def test_heads_must_divide_model_width():
    err = plan_error(tiny_spec(model={"n_head": 3}))
    assert err.field == "model.n_head" and "n_head=3 does not divide d_model=32" in err.message


MOE = {"experts": 4, "top_k": 2, "every": 2}


@pytest.mark.parametrize("field,overrides,message", [
    ("model.moe.top_k", {"model": {"moe": {**MOE, "top_k": 5}}}, "top_k=5 exceeds experts=4"),
    ("model.moe.every", {"model": {"moe": {**MOE, "every": 3}}}, "every=3 exceeds n_layer=2"),
    ("parallel.ep", {"model": {"moe": MOE}, "parallel": {"dp": 3, "ep": 2}}, "ep=2 does not divide dp=3"),
    ("parallel.ep", {"model": {"moe": {**MOE, "experts": 6}}, "parallel": {"dp": 4, "ep": 4}},
     "ep=4 does not divide experts=6"),
    ("parallel.ep", {"parallel": {"dp": 2, "ep": 2}}, "ep=2 needs mixture-of-experts layers"),
    ("parallel.tp", {"model": {"moe": MOE, "seq_len": 15, "n_head": 4}, "parallel": {"tp": 2}},
     "tp=2 does not divide seq_len=15"),
])
def test_mixture_of_experts_rules_name_the_field(field, overrides, message):
    err = plan_error(tiny_spec(**overrides))
    assert err.field == field and message in err.message


def test_dp_larger_than_the_cluster_can_ever_hold_is_refused_with_needed_vs_available():
    cluster = ClusterResources(nodes=(NodeResources(cpus=2, gpus=0), NodeResources(cpus=2, gpus=0)))
    err = plan_error(tiny_spec(parallel={"dp": 8}), cluster)
    assert err.field == "parallel.dp"
    assert "needs 8 workers (8 CPU" in err.message and "can ever hold only 4" in err.message


def test_a_job_that_fits_the_cluster_is_planned():
    cluster = ClusterResources(nodes=(NodeResources(cpus=2, gpus=0), NodeResources(cpus=2, gpus=0)))
    assert make_plan(parse_spec(tiny_spec(parallel={"dp": 4})), cluster).world_size == 4


def test_gpus_auto_follows_the_cluster():
    gpu_cluster = ClusterResources(nodes=(NodeResources(cpus=8, gpus=2),))
    assert make_plan(parse_spec(tiny_spec(parallel={"dp": 2})), gpu_cluster).gpus_per_worker == 1
    assert make_plan(parse_spec(tiny_spec()), ClusterResources(nodes=(NodeResources(8, 0),))).gpus_per_worker == 0
    err = plan_error(tiny_spec(parallel={"dp": 4}), gpu_cluster)
    assert "can ever hold only 2" in err.message


def test_missing_dataset_file_is_refused(tmp_path):
    config = parse_spec(tiny_spec(data={"kind": "text", "path": str(tmp_path / "nope.txt")}))
    with pytest.raises(DatasetError) as info:
        open_dataset(config)
    assert info.value.field == "data.path" and "file not found" in info.value.message


def test_dataset_shorter_than_one_sequence_is_refused(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DatasetError, match="needs at least 17"):
        open_dataset(parse_spec(tiny_spec(data={"kind": "text", "path": str(short)})))


def test_text_data_needs_byte_vocabulary():
    err = plan_error(tiny_spec(model={"vocab_size": 100}))
    assert err.field == "model.vocab_size"


def test_demo_spec_is_valid():
    config = parse_spec(load_spec_text((REPO / "examples" / "demo.yaml").read_text()))
    assert make_plan(config).dp == 2


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_spec_plans(path):
    spec = load_spec_text(path.read_text())
    spec["data"] = {**spec["data"], "path": str(REPO / spec["data"]["path"])}
    if "init_from" in spec:  # the architecture is the base's config.json: finetune.yaml's is what llama.yaml exports
        base = load_spec_text((REPO / "examples" / "llama.yaml").read_text())["model"]
        spec["model"] = {**base, **spec.get("model", {})}
    plan = make_plan(parse_spec(spec))
    assert plan.world_size == plan.dp * plan.pp * plan.tp >= 1
