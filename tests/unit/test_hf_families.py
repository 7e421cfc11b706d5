"""Llama's kin and Hugging Face, without a process group: each family's config.json and tensor names both
ways against transformers' own classes (what `save_pretrained` writes is exactly what the family maps), each
tiny checkpoint's logits through `init_from`'s loader, the config.json fields each family refuses by name, the
sliding window's effect, the job event that names the family claiming a directory, and every field of transformers'
configs away from its default: a family claims a directory only where it computes transformers' logits."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import slow
from hf_tiny import tiny_mistral, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe
from pydantic import TypeAdapter
from safetensors import safe_open
from trainyard.parallel.config import ModelConfig, RuleError
from trainyard.parallel.io.hf_checkpoint import load_into
from trainyard.parallel.io.hf_spec import init_from_event, model_fields
from trainyard.parallel.models import FAMILIES
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.spec import parse_spec

BUILD = {"qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "mistral": tiny_mistral, "qwen3_moe": tiny_qwen3_moe}
TOL = 1e-5


def model_cfg(fields: dict) -> ModelConfig:
    return TypeAdapter(ModelConfig).validate_python({**fields, "seq_len": 16})


def file_keys(directory) -> set[str]:
    with safe_open(directory / "model.safetensors", "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("kin")
    return {name: (build(root / name), root / name) for name, build in BUILD.items()}


@pytest.mark.parametrize("name", list(BUILD))
def test_a_tiny_checkpoint_loads_with_transformers_logits(checkpoints, name):
    hf, directory = checkpoints[name]
    cfg = model_cfg(model_fields(directory))
    assert cfg.family == name
    ours = full_model(cfg, seed=0)
    load_into([ours], cfg, directory)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.lm_head(ours.ln_f(ours(ids))), hf(ids).logits, rtol=0, atol=TOL)


@pytest.mark.parametrize("name", list(BUILD))
def test_config_and_names_map_both_ways(checkpoints, name, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    _, directory = checkpoints[name]
    fields = model_fields(directory)
    cfg = model_cfg(fields)
    adapter = FAMILIES[name].hf
    written = adapter.config_to_hf(cfg)
    assert written["architectures"] == list(adapter.ARCHITECTURES)
    assert adapter.config_from_hf(written) == fields  # config.json -> ModelConfig -> config.json -> the same
    (tmp_path / "config.json").write_text(json.dumps(written))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).save_pretrained(tmp_path)
    sources = adapter.sources(cfg)
    assert {s.key for s in sources.values()} == file_keys(tmp_path) == file_keys(directory)
    ours = dict(full_model(cfg, seed=0).named_parameters(remove_duplicate=False))
    assert set(sources) == set(ours)


@pytest.mark.parametrize("name,change,field", [
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("mistral", {"layer_types": ["sliding_attention"] * 2}, "layer_types"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "intermediate_size"),  # dense blocks 48 wide, experts 24
])
def test_what_a_family_cannot_honour_is_refused_by_name(checkpoints, name, change, field):
    _, directory = checkpoints[name]
    hf = json.loads((directory / "config.json").read_text()) | change
    with pytest.raises(RuleError) as info:
        FAMILIES[name].hf.config_from_hf(hf)
    assert info.value.field == field


def test_qwen3_moe_reads_its_sparse_step_and_both_spellings_of_the_expert_count(checkpoints):
    _, directory = checkpoints["qwen3_moe"]
    hf = json.loads((directory / "config.json").read_text())
    adapter = FAMILIES["qwen3_moe"].hf
    hf.pop("num_local_experts")
    fields = adapter.config_from_hf(hf | {"num_experts": 8, "decoder_sparse_step": 2, "intermediate_size": 24})
    assert fields["moe"] == {"experts": 8, "top_k": 2, "every": 2, "norm_topk_prob": False}
    assert fields["ffn_hidden"] == 24 and fields["head_dim"] == 16


def test_the_sliding_window_changes_what_mistral_computes():
    window = model_cfg({"family": "mistral", "n_layer": 1, "n_head": 4, "n_kv_head": 2, "d_model": 32,
                        "ffn_hidden": 48, "sliding_window": 4})
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = full_model(window, seed=0)(ids)
        b = full_model(model_cfg({**window.__dict__, "sliding_window": None}), seed=0)(ids)
    assert torch.equal(a[:, :4], b[:, :4])  # the first positions see their whole past either way
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_the_job_event_names_the_family_that_claimed_the_directory(checkpoints):
    from helpers import tiny_spec
    from trainyard.api.spec import parse_submitted_spec

    _, directory = checkpoints["qwen3"]
    spec = tiny_spec(init_from={"hf": str(directory)})
    spec["model"] = {"seq_len": 16}
    event = init_from_event(parse_submitted_spec(spec), now=1.0)
    assert event == {"time": 1.0, "kind": "init_from", "hf": str(directory), "architectures": ["Qwen3ForCausalLM"],
                     "family": "qwen3", "backend": False}
    assert init_from_event(parse_spec(tiny_spec()), now=1.0) is None


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen3_moe"])
def test_lora_adapts_the_kin_and_the_memory_plan_counts_their_adapters(checkpoints, name):
    from trainyard.parallel.models.components.lora import apply_lora, is_adapter

    _, directory = checkpoints[name]
    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    cfg = model_cfg(model_fields(directory) | {"lora": {"rank": 4, "alpha": 8, "targets": targets}})
    ours = apply_lora(full_model(cfg, seed=0), seed=0)
    adapters = sum(p.numel() for n, p in ours.named_parameters() if is_adapter(n))
    assert adapters > 0 and FAMILIES[name].adapter_elements(cfg, range(cfg.n_layer), tp=1) == adapters


NATIVE_CONFIGS = {
    "LlamaConfig": {}, "MixtralConfig": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "MistralConfig": {"sliding_window": 5}, "Qwen2Config": {}, "Qwen3Config": {"head_dim": 16},
    "Qwen3MoeConfig": {"head_dim": 16, "moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2},
}
TINY = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
INERT = {"architectures", "dtype", "transformers_version", "use_cache", "output_attentions", "output_hidden_states",
         "return_dict", "id2label", "label2id", "initializer_range", "problem_type", "chunk_size_feed_forward",
         "is_encoder_decoder", "_name_or_path", "pad_token_id", "bos_token_id", "eos_token_id", "model_type"}
"""config.json fields that name things or steer initialisation and generation, never a trained model's numbers."""


def _other_value(key: str, value):
    """A value of a config.json field other than its default, that transformers may build (None: none to try)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 0.1
    if isinstance(value, dict):  # rope_parameters
        return value | {"partial_rotary_factor": 0.5}
    if isinstance(value, list) and value and value[0] == "full_attention":  # layer_types
        return ["sliding_attention", *value[1:]]
    return {"hidden_act": "gelu", "sliding_window": 4, "head_dim": 16}.get(key)


def _perturbed(config_class: str) -> list[tuple[str, str, object]]:
    """(config class, field, a value away from its default) for each field of the class but `INERT`'s."""
    try:
        import transformers
    except ImportError:  # the tests that need it fail on their own
        return []
    defaults = getattr(transformers, config_class)(**TINY, **NATIVE_CONFIGS[config_class]).to_dict()
    cases = [(config_class, key, _other_value(key, value)) for key, value in defaults.items() if key not in INERT]
    return [case for case in cases if case[2] is not None]


def _claimed_natively_computes_transformers_logits(config_class: str, key: str, value, tmp_path) -> None:
    import transformers
    from hf_tiny import _saved

    fields = getattr(transformers, config_class)(**TINY, **NATIVE_CONFIGS[config_class]).to_dict() | {key: value}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        torch.manual_seed(0)
        theirs = _saved(transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, config_class).from_dict(fields)), tmp_path)
        with torch.no_grad():
            logits = theirs(ids, use_cache=False).logits
    except Exception as e:  # noqa: BLE001 - a value transformers refuses is no model to compare
        pytest.skip(f"transformers runs no {config_class} with {key}={value!r}: {e!r}"[:200])
    try:
        model = model_cfg(model_fields(tmp_path))
    except RuleError:
        return  # refused at submit, naming the field: no silent difference
    if model.family == "hf":
        return  # left to the transformers backend: no silent difference
    ours = full_model(model, seed=0)
    load_into([ours], model, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours.lm_head(ours.ln_f(ours(ids))), logits, rtol=0, atol=TOL,
                                   msg=f"{model.family} claims {config_class} with {key}={value!r}")


@pytest.mark.parametrize("config_class,key,value", _perturbed("LlamaConfig"))
def test_a_native_family_claims_a_field_away_from_its_default_only_where_it_computes_it(config_class, key, value,
                                                                                         tmp_path):
    """Every field of transformers' LlamaConfig but names, each away from its default: llama claims the directory
    only where its logits are transformers' (a field it does not implement goes to the backend). A new
    transformers field that changes the numbers fails here until the family implements it or leaves it."""
    _claimed_natively_computes_transformers_logits(config_class, key, value, tmp_path)


@slow
@pytest.mark.parametrize("config_class,key,value", [c for name in NATIVE_CONFIGS if name != "LlamaConfig"
                                                    for c in _perturbed(name)])
def test_every_native_family_claims_a_field_away_from_its_default_only_where_it_computes_it(config_class, key,
                                                                                            value, tmp_path):
    _claimed_natively_computes_transformers_logits(config_class, key, value, tmp_path)
