"""Hugging Face checkpoints in process: the families' mappings both ways, trainyard's model loaded from an HF
directory against transformers' logits, the export direction, and the config.json fields refused by name."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hf_tiny import tiny_gpt2, tiny_llama, tiny_mixtral
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from trainyard.api.spec import parse_submitted_spec
from trainyard.parallel.config import RuleError
from trainyard.parallel.io import hf_checkpoint
from trainyard.parallel.io.export import export_hf, load_exported
from trainyard.parallel.io.hf_spec import adapter_for_family, model_fields
from trainyard.parallel.models.components import hf_mapping
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.spec import parse_spec

BUILDERS = {"gpt2-tied": lambda d: tiny_gpt2(d), "gpt2-untied": lambda d: tiny_gpt2(d, tied=False),
            "llama-gqa-untied": lambda d: tiny_llama(d), "llama-tied": lambda d: tiny_llama(d, tied=True),
            "mixtral": lambda d: tiny_mixtral(d),
            "llama-rope-llama3": lambda d: tiny_llama(d, rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})}


def model_config(directory, **model):
    return parse_submitted_spec({"init_from": {"hf": str(directory)}, "model": {"seq_len": 16, **model},
                                 "steps": 1}).model


def disk_state(directory) -> dict[str, torch.Tensor]:
    with safe_open(directory / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("kind", ["gpt2-tied", "gpt2-untied", "llama-gqa-untied", "llama-tied", "mixtral"])
def test_hf_to_trainyard_to_hf_keeps_every_name_shape_and_value(kind, tmp_path):
    BUILDERS[kind](tmp_path)
    cfg = model_config(tmp_path)
    adapter = adapter_for_family(cfg.family)
    hf = disk_state(tmp_path)
    ours = hf_mapping.from_hf(hf, adapter.sources(cfg, hf.keys()))
    assert set(ours) == set(full_model(cfg, 0).state_dict())  # every trainyard tensor, a tied head too
    back = hf_mapping.to_hf(ours, adapter.sources(cfg, hf.keys()))
    assert back.keys() == hf.keys()
    for key, tensor in hf.items():
        assert torch.equal(back[key], tensor), key


def test_fused_mixtral_experts_in_memory_map_like_the_per_expert_files(tmp_path):
    model = tiny_mixtral(tmp_path)
    cfg = model_config(tmp_path)
    fused = model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused  # transformers 5 fuses them in memory
    adapter = adapter_for_family("llama")
    from_fused = hf_mapping.from_hf(fused, adapter.sources(cfg, fused.keys()))
    from_disk = hf_mapping.from_hf(disk_state(tmp_path), adapter.sources(cfg, disk_state(tmp_path).keys()))
    assert from_fused.keys() == from_disk.keys()
    assert all(torch.equal(from_fused[k], from_disk[k]) for k in from_disk)


def assert_loads_with_transformers_logits(theirs, directory) -> None:
    """trainyard's model of the same config.json, loaded from `directory` (as given), computes transformers' logits."""
    cfg = model_config(directory)
    ours = full_model(cfg, seed=3)
    hf_checkpoint.load_into([ours], cfg, Path(directory))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.lm_head(ours.ln_f(ours(tokens))), theirs(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2-tied", "llama-gqa-untied", "mixtral", "llama-rope-llama3"])
def test_trainyard_model_loaded_from_hf_gives_transformers_logits(kind, tmp_path):
    theirs = BUILDERS[kind](tmp_path)
    assert_loads_with_transformers_logits(theirs, tmp_path)


@pytest.mark.parametrize("left_out", ["rope_parameters", "rms_norm_eps"])
def test_a_field_config_json_leaves_out_takes_the_architectures_default(left_out, tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_mixtral(tmp_path)  # Mixtral's defaults (rope_theta 1e6, rms_norm_eps 1e-5) are not Llama's
    config = json.loads((tmp_path / "config.json").read_text())
    del config[left_out]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_loads_with_transformers_logits(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), tmp_path)


@pytest.mark.parametrize("kind", ["gpt2-tied", "gpt2-untied", "llama-gqa-untied", "mixtral", "llama-rope-llama3"])
def test_exported_model_loads_in_transformers_with_equal_logits(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    BUILDERS[kind](tmp_path / "src")
    cfg = model_config(tmp_path / "src")
    ours = full_model(cfg, seed=5)  # trainyard's own weights, not the source's
    exported = tmp_path / "model.safetensors"
    save_exported(ours, cfg, exported)
    out = export_hf(exported, tmp_path / "hf", max_shard_bytes=40_000)  # forces several shards
    assert (out / "model.safetensors.index.json").is_file() and (out / "generation_config.json").is_file()
    theirs, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(tokens).logits, ours.lm_head(ours.ln_f(ours(tokens))),
                                   rtol=0, atol=1e-5)


def save_exported(model, cfg, path) -> None:
    """`model` as trainyard's export writes it (parallel.io.export.export_model)."""
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"config": json.dumps(asdict(cfg)), "step": "1"})


def test_the_export_hint_loads_a_moe_model(tmp_path):
    tiny_mixtral(tmp_path / "src")
    cfg = model_config(tmp_path / "src")
    ours = full_model(cfg, seed=5)
    path = tmp_path / "model.safetensors"
    save_exported(ours, cfg, path)
    loaded = load_exported(path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.state_dict().items())


def prepared_data_and_model(tmp_path) -> tuple[Path, Path]:
    """A prepared dataset directory's tokenizer files (word level: <eos> a b) and an exported llama."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    data = tmp_path / "data"
    data.mkdir()
    tokenizer = Tokenizer(models.WordLevel({"<eos>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(data / "tokenizer.json"))
    (data / "manifest.json").write_text(json.dumps({"eos_id": 0, "tokenizer": {"eos_token": "<eos>"}}))
    tiny_llama(tmp_path / "src")
    cfg = model_config(tmp_path / "src")
    path = tmp_path / "job" / "model.safetensors"
    path.parent.mkdir()
    save_exported(full_model(cfg, 0), cfg, path)
    return data, path


def test_export_copies_the_tokenizer_of_a_prepared_dataset(tmp_path):
    from transformers import AutoTokenizer

    data, path = prepared_data_and_model(tmp_path)
    out = export_hf(path, tmp_path / "hf", tokenizer_from=data)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    assert AutoTokenizer.from_pretrained(out)("a b a")["input_ids"] == [1, 2, 1]


def test_the_services_hf_archive_finds_the_tokenizer_of_a_data_path_under_home(tmp_path, monkeypatch):
    import tarfile

    from trainyard.service.hf_export import hf_archive

    monkeypatch.setenv("HOME", str(tmp_path))
    _, path = prepared_data_and_model(tmp_path)
    with tarfile.open(hf_archive(path, {"data": {"kind": "tokens", "path": "~/data"}})) as tar:
        assert "tokenizer.json" in tar.getnames()  # the job read its data at ~/data: the export must too


def test_export_refuses_a_model_hugging_face_has_no_form_for(tmp_path):
    cfg = parse_spec({"model": {"n_layer": 2, "n_head": 2, "d_model": 16, "moe": {"experts": 2}}, "steps": 1}).model
    with pytest.raises(RuleError) as info:
        hf_checkpoint.write_hf_dir(tmp_path / "hf", cfg, full_model(cfg, 0).state_dict())
    assert info.value.field == "model.moe"


@pytest.mark.parametrize("build,field", [
    (lambda d: tiny_llama(d, attention_bias=True), "attention_bias"),
    (lambda d: tiny_llama(d, mlp_bias=True), "mlp_bias"),
    (lambda d: tiny_llama(d, hidden_act="gelu"), "hidden_act"),
    (lambda d: tiny_mixtral(d, sliding_window=16), "sliding_window"),
    (lambda d: tiny_llama(d, rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type"),
    (lambda d: tiny_gpt2(d, scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (lambda d: tiny_gpt2(d, activation_function="relu"), "activation_function"),
])
def test_config_fields_a_native_family_does_not_implement_leave_it_to_the_backend(build, field, tmp_path):
    """No native family claims a directory it would train otherwise: the backend takes it (Mixtral's experts, one
    tensor each in its checkpoints, it then refuses at plan time naming why); without transformers, a 422."""
    build(tmp_path)
    assert model_fields(tmp_path)["family"] == "hf"
    hf = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(RuleError) as info:
        adapter_for_family(model_fields_family(hf)).config_from_hf(hf)
    assert info.value.field.startswith(field)


def model_fields_family(hf: dict) -> str:
    from trainyard.parallel.io.hf_spec import native_adapter

    return native_adapter(hf).FAMILY


def test_legacy_rope_scaling_spelling_reads_like_rope_parameters(tmp_path):
    tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    config |= {"rope_theta": 500000.0, "rope_scaling": scaling}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = model_config(tmp_path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.factor == 8.0
    assert load_file(str(tmp_path / "model.safetensors"))  # the weights are untouched


def test_an_expert_parallel_stage_reads_only_the_experts_it_hosts(tmp_path):
    from trainyard.parallel.models import family_of

    theirs = tiny_mixtral(tmp_path)
    cfg = model_config(tmp_path)
    stage = family_of(cfg).build_stage(cfg, [1], first=False, last=True, seed=0, experts=[2, 3])
    files = hf_checkpoint.load_into([stage], cfg, tmp_path)
    read = {key for key, _ in files.reads}
    assert {k for k in read if ".experts." in k} == {f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
                                                     for e in (2, 3) for w in ("w1", "w2", "w3")}
    assert not any(k.startswith("model.layers.0.") or k == "model.embed_tokens.weight" for k in read)
    fused = theirs.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(stage.blocks["1"].moe.experts["3"].up.weight, fused[3, 48:], rtol=0, atol=0)


@pytest.mark.parametrize("build,field,value", [(tiny_llama, "vocab_size", 200), (tiny_llama, "intermediate_size", 40),
                                               (tiny_gpt2, "n_inner", 64)])  # gpt2: 4 x 32 = 128, a Conv1D
def test_weights_larger_than_config_json_says_are_refused_not_cropped(build, field, value, tmp_path):
    build(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = model_config(tmp_path)
    with pytest.raises(RuleError) as info:  # a rank reads only its blocks: the rest would go unnoticed
        hf_checkpoint.load_into([full_model(cfg, 0)], cfg, tmp_path)
    assert info.value.field == "init_from.hf" and "its config.json implies" in info.value.message


@pytest.mark.parametrize("kind,embedding", [("gpt2-tied", "transformer.wte.weight"),
                                            ("llama-tied", "model.embed_tokens.weight")])
def test_a_tied_checkpoint_that_also_stores_the_head_loads_as_transformers_loads_it(kind, embedding, tmp_path):
    theirs = BUILDERS[kind](tmp_path)
    state = disk_state(tmp_path)
    assert "lm_head.weight" not in state
    save_file(state | {"lm_head.weight": state[embedding].clone()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})  # as some conversions write a tied model
    assert_loads_with_transformers_logits(theirs, tmp_path)


def test_a_directory_under_home_submits_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    theirs = tiny_llama(tmp_path / "models" / "tiny")
    # the submit reads config.json at "~/models/tiny", and the trainer passes init_from.hf as given: so must the ranks
    assert_loads_with_transformers_logits(theirs, "~/models/tiny")


def test_a_truncated_or_misindexed_weights_file_is_named_in_the_error(tmp_path):
    tiny_llama(tmp_path)
    cfg = model_config(tmp_path)
    weights = tmp_path / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # a download cut short
    with pytest.raises(RuleError) as info:
        hf_checkpoint.load_into([full_model(cfg, 0)], cfg, tmp_path)
    assert info.value.field == "init_from.hf" and f"{weights} is not a readable safetensors file" in info.value.message
    weights.write_bytes(whole)
    state = disk_state(tmp_path)
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(tmp_path / "a.safetensors"))
    save_file({"lm_head.weight": state["lm_head.weight"]}, str(tmp_path / "b.safetensors"))
    weight_map = dict.fromkeys(state, "a.safetensors")  # the index puts lm_head.weight in the wrong file
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(RuleError) as info:
        hf_checkpoint.load_into([full_model(cfg, 0)], cfg, tmp_path)
    assert f"{tmp_path / 'a.safetensors'}:" in info.value.message and "lm_head.weight" in info.value.message
