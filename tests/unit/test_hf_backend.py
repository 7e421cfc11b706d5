"""The transformers backend (`model.family: hf`) at submit and in the plan, in this process: it claims what no native
family reads (a native family first), a directory neither can train is a 422 naming the architecture, the layouts it
cannot take are refused naming their field, the memory plan counts the model's parameters exactly (built on the
meta device), `trainyard plan` names the backend and its limits, and the submit's event names the family."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_spec
from hf_tiny import tiny_backend, tiny_llama
from trainyard.api.spec import parse_submitted_spec
from trainyard.cli.offline import format_plan
from trainyard.parallel.io.hf_spec import init_from_event
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.plan.memory.estimate import param_counts, rank_memory
from trainyard.parallel.plan.present import describe
from trainyard.parallel.spec import SpecError


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("olmo2")
    return directory, tiny_backend("olmo2", directory)


def spec(directory, **overrides) -> dict:
    s = tiny_spec(init_from={"hf": str(directory)}, global_batch=4, **overrides)
    s["model"] = {"seq_len": 16}
    return s


def test_the_backend_takes_what_no_native_family_reads_and_a_native_family_first(olmo2, tmp_path):
    cfg = parse_submitted_spec(spec(olmo2[0])).model
    assert (cfg.family, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.vocab_size) == ("hf", 2, 4, 32, 256)
    assert json.loads(cfg.hf_config)["architectures"] == ["Olmo2ForCausalLM"]
    tiny_llama(tmp_path)  # LlamaForCausalLM is also an AutoModelForCausalLM architecture: llama claims it
    assert parse_submitted_spec(spec(tmp_path)).model.family == "llama"
    event = init_from_event(parse_submitted_spec(spec(olmo2[0])), now=1.0)
    assert (event["kind"], event["family"], event["architectures"], event["backend"]) == \
        ("init_from", "hf", ["Olmo2ForCausalLM"], True)


def test_a_directory_neither_can_train_is_refused_naming_the_architecture(olmo2, tmp_path):
    for f in olmo2[0].iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["BertModel"]}))
    with pytest.raises(SpecError) as info:
        parse_submitted_spec(spec(tmp_path))
    [(field, message)] = info.value.errors
    assert field == "init_from.hf" and "BertModel" in message and "AutoModelForCausalLM" in message


@pytest.mark.parametrize("overrides,field", [
    ({"parallel": {"pp": 2, "microbatches": 2}}, "parallel.pp"),
    ({"parallel": {"tp": 2}}, "parallel.tp"),
    ({"parallel": {"dp": 2, "ep": 2}}, "parallel.ep"),
    ({"activation_checkpointing": "selective"}, "activation_checkpointing"),
])
def test_what_needs_a_native_family_is_refused_naming_the_field(olmo2, overrides, field):
    with pytest.raises(PlanError) as info:
        make_plan(parse_submitted_spec(spec(olmo2[0], **overrides)))
    assert info.value.field == field and "native model family" in info.value.message


def test_the_plan_counts_the_models_parameters_and_names_the_backend(olmo2):
    directory, model = olmo2
    plan = make_plan(parse_submitted_spec(spec(directory, parallel={"dp": 2, "zero": 3})))
    elements = sum(p.numel() for p in model.parameters())
    assert param_counts(plan, 0).total == elements  # built on meta and counted: exact
    assert rank_memory(make_plan(parse_submitted_spec(spec(directory))), 0).params == 4 * elements  # fp32, whole
    text = format_plan(describe(plan))
    assert "transformers backend, Olmo2ForCausalLM" in text and "no pp, tp" in text
