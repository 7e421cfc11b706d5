"""`init_from: {hf: DIR}` at submit, without a server: the architecture comes from config.json, a `model` that
says otherwise is refused listing each differing field, what trainyard cannot read is a 422 naming it, and a field
a native family does not implement leaves the directory to the transformers backend, the event naming it."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from helpers import tiny_spec
from hf_tiny import tiny_gpt2, tiny_llama
from trainyard.api.app import create_app
from trainyard.api.spec import parse_submitted_spec
from trainyard.parallel.spec import SpecError
from trainyard.service.manager import JobManager
from trainyard.service.store import JobStore


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    tiny_llama(directory)
    return directory


def submitted(directory, **model) -> dict:
    spec = tiny_spec(init_from={"hf": str(directory)})
    spec["model"] = model
    return spec


def errors(spec: dict) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        parse_submitted_spec(spec)
    return info.value.errors


def test_the_architecture_comes_from_config_json(llama_dir):
    cfg = parse_submitted_spec(submitted(llama_dir, seq_len=16)).model
    assert (cfg.family, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.ffn_hidden) == ("llama", 2, 4, 2,
                                                                                                  32, 48)
    assert cfg.seq_len == 16 and not cfg.tie_embeddings
    spec = submitted(llama_dir)
    del spec["model"]  # `model` may be left out
    assert parse_submitted_spec(spec).model.n_kv_head == 2


def test_a_model_that_differs_from_config_json_lists_each_field(llama_dir):
    [(field, message)] = errors(submitted(llama_dir, n_layer=2, n_head=8, d_model=64, seq_len=16))
    assert field == "model"
    assert "model.n_head: 8 (config.json: 4)" in message and "model.d_model: 64 (config.json: 32)" in message
    assert "n_layer" not in message  # equal fields are no difference


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("build,same,other", [
    (tiny_gpt2, {"ffn_hidden": 128}, {"ffn_hidden": 64}),  # config.json's n_inner: null is 4 x n_embd = 128
    (tiny_llama, {"head_dim": 8}, {"head_dim": 16}),  # no head_dim in the model: hidden_size / heads = 8
    (lambda d: tiny_llama(d, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, **LLAMA3}),
     {"rope_scaling": LLAMA3}, {"rope_scaling": LLAMA3 | {"factor": 4.0}}),  # rope_type's default is llama3
])
def test_a_model_field_spelled_otherwise_with_the_same_meaning_is_no_difference(build, same, other, tmp_path):
    build(tmp_path)  # e.g. the spec that trained a model, given again with the model's HF export as init_from
    assert parse_submitted_spec(submitted(tmp_path, seq_len=16, **same)).model.family
    [(field, message)] = errors(submitted(tmp_path, seq_len=16, **other))
    assert field == "model" and f"model.{next(iter(other))}:" in message


@pytest.mark.parametrize("change,named", [
    (lambda c: c | {"architectures": ["BertModel"]}, "architectures"),  # no causal LM: neither a native family nor hf
    (lambda c: c | {"num_attention_heads": 0}, "integer modulo by zero"),  # a garbled config.json: a 422, not a 500
    (lambda c: c | {"rope_parameters": [10000.0]}, "'list' object has no attribute"),
    (lambda c: c | {"rms_norm_eps": "tiny"}, "could not convert string to float"),
    (lambda c: c | {"tie_word_embeddings": "false"}, "tie_word_embeddings"),  # truthy: the head would be dropped
    (lambda c: c | {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_what_trainyard_cannot_honour_is_refused_by_name(change, named, llama_dir, tmp_path):
    for f in llama_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(change(json.loads((llama_dir / "config.json").read_text()))))
    [(field, message)] = errors(submitted(tmp_path, seq_len=16))
    assert field == "init_from.hf" and f"field {named}" in message


@pytest.mark.parametrize("change,named", [
    (lambda c: c | {"attention_bias": True}, "attention_bias"),
    (lambda c: c | {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type"),
    (lambda c: c | {"sliding_window": 4}, "sliding_window"),
    (lambda c: c | {"model_type": "exaone"}, "model_type"),  # transformers maps EXAONE to LlamaForCausalLM
])
def test_what_a_native_family_does_not_implement_goes_to_the_backend_naming_the_field(change, named, llama_dir,
                                                                                       tmp_path):
    from trainyard.parallel.io.hf_spec import init_from_event

    for f in llama_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(change(json.loads((llama_dir / "config.json").read_text()))))
    config = parse_submitted_spec(submitted(tmp_path, seq_len=16))
    assert config.model.family == "hf"  # LlamaForCausalLM, trained as transformers defines it: never silently
    event = init_from_event(config, now=1.0)
    assert event["backend"] and f"field {named}" in event["not_native"], event


def test_a_missing_directory_or_file_is_refused(tmp_path):
    [(field, message)] = errors(submitted(tmp_path / "nowhere", seq_len=16))
    assert field == "init_from.hf" and "is not a directory" in message
    tiny_gpt2(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    [(field, message)] = errors(submitted(tmp_path, seq_len=16))
    assert field == "init_from.hf" and "model.safetensors" in message


def test_the_api_answers_422_naming_the_field_and_creates_nothing(llama_dir, tmp_path):
    # A manager without Ray that admits nothing: the spec is refused before anything would be planned.
    manager = JobManager(JobStore(tmp_path / "jobs.db"), admit=False)
    client = TestClient(create_app(manager=manager, token="t"), raise_server_exceptions=True)
    auth = {"Authorization": "Bearer t"}
    bad = client.post("/api/jobs", headers=auth, json=submitted(llama_dir, n_head=8, seq_len=16))
    assert bad.status_code == 422
    [detail] = bad.json()["detail"]
    assert detail["field"] == "model" and detail["loc"] == ["body", "model"] and "model.n_head: 8" in detail["msg"]
    missing = client.post("/api/plans", headers=auth, json=submitted(llama_dir / "nowhere"))
    assert missing.status_code == 422 and missing.json()["detail"][0]["field"] == "init_from.hf"
    assert manager.list() == []
    manager.shutdown()


@pytest.mark.parametrize("damage,named", [
    (lambda d: sorted(d.glob("model-*.safetensors"))[1].unlink(), "lacks shard files"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{not json"), "is not a safetensors index"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{}"), "is not a safetensors index"),
])
def test_a_sharded_checkpoint_with_a_missing_shard_or_a_broken_index_is_refused(damage, named, llama_dir, tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(llama_dir).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    damage(tmp_path)
    [(field, message)] = errors(submitted(tmp_path, seq_len=16))
    assert field == "init_from.hf" and named in message
