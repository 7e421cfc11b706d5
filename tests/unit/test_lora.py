"""LoRA in one process (no Ray, no process group): the spec's rules, the adapters' init against PEFT's own
`LoraLayer`, their names, the adapted model against PEFT's on a tiny HF Llama (both export directions and
`init_from.adapter`), and the memory plan's counts against the built model's."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_spec
from hf_tiny import tiny_llama
from trainyard.api.spec import parse_submitted_spec
from trainyard.parallel.config import RuleError
from trainyard.parallel.io import hf_checkpoint, peft_adapter
from trainyard.parallel.models import family_of
from trainyard.parallel.models.components.lora import adapter_names, apply_lora, init_adapter, is_adapter, merged
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.plan.memory.estimate import rank_memory
from trainyard.parallel.seeds import derive_seed
from trainyard.parallel.spec import SpecError, parse_spec

ALL_LLAMA = ["q", "k", "v", "o", "gate", "up", "down"]


def lora_spec(directory=None, **lora) -> dict:
    spec = tiny_spec(**({"init_from": {"hf": str(directory)}} if directory is not None else {}))
    spec["model"] = {"seq_len": 16, "lora": {"rank": 4, "alpha": 8, "targets": ALL_LLAMA} | lora}
    if directory is None:
        spec["model"] |= {"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32,
                          "ffn_hidden": 48}
    return spec


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny HF Llama, and trainyard's model of it with every projection adapted, B made non-zero."""
    directory = tmp_path_factory.mktemp("lora") / "llama"
    base = tiny_llama(directory)
    cfg = parse_submitted_spec(lora_spec(directory)).model
    ours = apply_lora(full_model(cfg, 7), seed=7)
    hf_checkpoint.load_into([ours], cfg, directory)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(derive_seed(1, name))))
    ours.eval()
    return base, cfg, ours, directory


def logits(model, tokens):
    with torch.no_grad():
        return model.lm_head(model.ln_f(model(tokens)))


TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def test_an_unknown_target_is_refused_naming_the_field_and_the_family_targets():
    with pytest.raises(PlanError) as info:
        make_plan(parse_spec(lora_spec(targets=["q", "c_attn"])))
    assert info.value.field == "model.lora.targets" and "c_attn" in info.value.message and "gate" in info.value.message
    with pytest.raises(PlanError) as info:
        make_plan(parse_spec(lora_spec(targets=["q", "q"])))
    assert info.value.field == "model.lora.targets"
    spec = lora_spec()
    spec["model"] |= {"family": "gpt2", "n_kv_head": None, "ffn_hidden": None}
    with pytest.raises(PlanError) as info:
        make_plan(parse_spec(spec | {"model": spec["model"] | {"lora": {"targets": ["gate"]}}}))
    assert "fc" in info.value.message
    assert make_plan(parse_spec(spec | {"model": spec["model"] | {"lora": {"targets": ["q", "o", "fc", "proj"]}}}))


@pytest.mark.parametrize(("lora", "field"), [({"rank": 0}, "model.lora.rank"), ({"alpha": 0}, "model.lora.alpha"),
                                             ({"dropout": 1.0}, "model.lora.dropout"),
                                             ({"targets": []}, "model.lora.targets"),
                                             ({"rank": True}, "model.lora.rank")])
def test_field_rules(lora, field):
    with pytest.raises(SpecError) as info:
        parse_spec(lora_spec(**lora))
    assert info.value.errors[0][0] == field


def test_an_adapter_to_start_from_needs_lora():
    spec = tiny_spec(init_from={"hf": "/nowhere", "adapter": "/nowhere"})
    with pytest.raises(PlanError) as info:
        make_plan(parse_spec(spec))
    assert info.value.field == "init_from.adapter"


def test_init_is_peft_loralayer_init_from_the_seed_and_name():
    from peft import LoraConfig
    from peft.tuners.lora import Linear as PeftLinear

    name = "blocks.1.attn.q.lora_A.weight"
    layer = PeftLinear(torch.nn.Linear(32, 24), "default", LoraConfig(r=4, lora_alpha=8), r=4, lora_alpha=8)
    torch.manual_seed(derive_seed(7, "param", name))  # PEFT draws from the global generator
    layer.reset_lora_parameters("default", init_lora_weights=True)
    assert torch.equal(init_adapter(7, name, (4, 32)), layer.lora_A["default"].weight)
    assert torch.equal(init_adapter(7, name.replace("lora_A", "lora_B"), (24, 4)), layer.lora_B["default"].weight)
    assert not torch.equal(init_adapter(8, name, (4, 32)), layer.lora_A["default"].weight)


def test_the_base_keeps_its_names_frozen_and_the_adapters_alone_train(hf):
    base, cfg, ours, _ = hf
    fresh = apply_lora(full_model(cfg, 7), seed=7)
    names = [n for n, _ in full_model(cfg, 7).named_parameters()]
    trained = [n for n, p in fresh.named_parameters() if p.requires_grad]
    assert [n for n, _ in fresh.named_parameters() if not is_adapter(n)] == names
    assert sorted(trained) == sorted(adapter_names(cfg)) and "blocks.0.attn.proj.lora_A.weight" in trained
    assert all(not p.requires_grad for n, p in fresh.named_parameters() if n in names)
    # B starts at zero: the adapted model is the base
    hf_checkpoint.load_into([fresh], cfg, hf[3])
    torch.testing.assert_close(logits(fresh, TOKENS), base(TOKENS).logits, rtol=0, atol=1e-5)


def test_the_peft_export_loads_in_peft_and_gives_our_logits(hf, tmp_path):
    from peft import PeftModel

    base, cfg, ours, directory = hf
    state = {n: t.detach() for n, t in ours.state_dict().items()}
    out = peft_adapter.write_peft_dir(tmp_path / "adapter", cfg, state, base=str(directory))
    config = json.loads((out / peft_adapter.CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == str(directory)
    from safetensors import safe_open

    with safe_open(out / peft_adapter.WEIGHTS, "pt") as f:
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in f.keys()
        assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in f.keys()
    theirs = PeftModel.from_pretrained(tiny_llama(tmp_path / "base"), out).eval()
    expected = logits(ours, TOKENS)
    assert (expected - base(TOKENS).logits).abs().max() > 1e-2  # the adapters change the model
    torch.testing.assert_close(theirs(TOKENS).logits, expected, rtol=0, atol=1e-5)
    # merged into the base: transformers' own model gives the same
    plain = full_model(cfg.__class__(**{**cfg.__dict__, "lora": None}), 0)
    plain.load_state_dict(merged(state, cfg.lora))
    torch.testing.assert_close(logits(plain, TOKENS), expected, rtol=0, atol=1e-5)
    # and init_from.adapter reads it back
    again = apply_lora(full_model(cfg, 3), seed=3)
    peft_adapter.load_into([again], cfg, out)
    assert all(torch.equal(p, state[n]) for n, p in again.named_parameters() if is_adapter(n))


def test_an_adapter_of_another_rank_or_targets_is_refused(hf, tmp_path):
    _, cfg, ours, _ = hf
    state = {n: t.detach() for n, t in ours.state_dict().items()}
    out = peft_adapter.write_peft_dir(tmp_path / "adapter", cfg, state)
    other = parse_submitted_spec(lora_spec(hf[3], rank=2)).model
    with pytest.raises(RuleError) as info:
        peft_adapter.load_into([apply_lora(full_model(other, 0), seed=0)], other, out)
    assert info.value.field == "init_from.adapter" and "r=4" in info.value.message
    fewer = parse_submitted_spec(lora_spec(hf[3], targets=["q", "v"])).model
    with pytest.raises(RuleError) as info:
        peft_adapter.load_into([apply_lora(full_model(fewer, 0), seed=0)], fewer, out)
    assert "unexpected" in info.value.message


def test_a_fused_gpt2_projection_has_no_peft_form():
    spec = lora_spec(targets=["q", "fc"])
    spec["model"] |= {"family": "gpt2", "n_kv_head": None, "ffn_hidden": None}
    cfg = parse_spec(spec).model
    with pytest.raises(RuleError) as info:
        peft_adapter.peft_keys(cfg, adapter_names(cfg))
    assert info.value.field == "model.lora.targets" and "c_attn" in info.value.message


@pytest.mark.parametrize("parallel", [{}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 3},
                                      {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}])
def test_the_memory_plan_counts_the_base_as_parameters_and_the_adapters_in_full(parallel):
    spec = lora_spec() | {"parallel": parallel}
    plan = make_plan(parse_spec(spec))
    cfg = plan.config.model
    adapters = sum(p.numel() for n, p in apply_lora(full_model(cfg, 0), seed=0).named_parameters() if is_adapter(n))
    assert family_of(cfg).adapter_elements(cfg, range(cfg.n_layer), tp=1) == adapters
    full = make_plan(parse_spec(spec | {"model": spec["model"] | {"lora": None}}))
    for rank in range(plan.world_size):
        mine, theirs = rank_memory(plan, rank), rank_memory(full, rank)
        assert mine.params > theirs.params  # the frozen base and the adapters
        assert mine.optimizer < theirs.optimizer / 4 and mine.grads < theirs.grads / 4
    # what the ranks measure (tests/integration/test_hf_gloo.py): AdamW's 8 bytes per adapter element held
    expected = {(): 8 * adapters, ("dp", "zero"): 8 * adapters // 2, ("dp", "microbatches", "pp", "tp"): 11008}
    assert rank_memory(plan, 0).optimizer == expected[tuple(sorted(parallel))]
