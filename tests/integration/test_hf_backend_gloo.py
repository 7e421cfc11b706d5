"""The transformers backend (`model.family: hf`) in one spawned world of 2 gloo ranks: three architectures no native
family reads (Phi-3, Gemma 2, OLMo 2; tiny, from their transformers configs, `save_pretrained` here), loaded with
`init_from`, give transformers' first loss (fp32), train at dp2 with ZeRO-3 and per-layer recompute following the
one-rank curve, resume at dp1 from the dp2 checkpoint onto the same curve, and export (`export --format hf`) a
directory transformers loads with no missing or unexpected keys and trainyard's logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gloo_ranks import PlanRun, run_plans
from helpers import tiny_spec
from hf_tiny import BACKEND_ARCHITECTURES, tiny_backend
from trainyard.api.spec import parse_submitted_spec
from trainyard.parallel.data.datasets import global_batch_ids, load_batch, open_dataset
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import make_plan

ATOL = 1e-5
CURVE_ATOL = 1e-4
STEPS = 3
LAYOUTS = {"z3": {"dp": 2, "zero": 3}, "one": {}}


def _spec(directory, parallel: dict, **extra) -> dict:
    spec = tiny_spec(init_from={"hf": str(directory)}, global_batch=4, steps=STEPS, parallel=parallel,
                     optimizer={"lr": 1e-2, "warmup_steps": 0}, **extra)
    spec["model"] = {"seq_len": 16}  # the architecture comes from config.json
    return spec


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Per architecture: the transformers model, its job config, and each run's per-rank results."""
    root = tmp_path_factory.mktemp("hfbackend")
    models = {name: tiny_backend(name, root / f"{name}-src") for name in BACKEND_ARCHITECTURES}
    configs = {(name, layout): parse_submitted_spec(_spec(root / f"{name}-src", par,
                                                          activation_checkpointing="full" if par else "none"))
               for name in models for layout, par in LAYOUTS.items()}
    runs = {key: PlanRun(make_plan(cfg), save_after=(1,) if key[1] == "z3" else (), root=str(root / "-".join(key)))
            for key, cfg in configs.items()}
    # after the dp2 run has saved: the same job at dp1 from its step-1 checkpoint
    runs |= {(name, "resumed"): PlanRun(make_plan(configs[name, "one"]),
                                        resume=(str(checkpoint.step_dir(root / f"{name}-z3", 1)), 1))
             for name in models}
    results = dict(zip(runs, run_plans(list(runs.values())), strict=True))
    curves = {key: [[s["loss"] for s in r.stats] for r in ranks] for key, ranks in results.items()}
    return models, configs, curves, root


def _hf_loss(model, config, step: int) -> float:
    ids = global_batch_ids(config.seed, step, config.global_batch, open_dataset(config).num_samples)
    inputs, targets = load_batch(open_dataset(config), ids)
    with torch.no_grad():
        logits = model(inputs).logits
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("name", BACKEND_ARCHITECTURES)
def test_the_backend_claims_what_no_native_family_reads(world, name):
    _, configs, _, _ = world
    assert configs[name, "one"].model.family == "hf"


@pytest.mark.parametrize("name", BACKEND_ARCHITECTURES)
def test_first_loss_is_transformers_and_dp2_zero3_follows_one_rank(world, name):
    models, configs, curves, _ = world
    one, z3 = curves[name, "one"][0], curves[name, "z3"]
    assert abs(one[0] - _hf_loss(models[name], configs[name, "one"], 0)) < ATOL
    for rank in z3:
        assert len(rank) == STEPS
        assert max(abs(a - b) for a, b in zip(rank, one, strict=True)) < CURVE_ATOL
    assert one[-1] < one[0]  # it learns


@pytest.mark.parametrize("name", BACKEND_ARCHITECTURES)
def test_resume_at_another_dp_continues_the_curve(world, name):
    _, _, curves, _ = world
    resumed, z3 = curves[name, "resumed"][0], curves[name, "z3"][0]
    assert len(resumed) == STEPS - 1  # steps 1 and 2
    assert max(abs(a - b) for a, b in zip(resumed, z3[1:], strict=True)) < CURVE_ATOL


@pytest.mark.parametrize("name", BACKEND_ARCHITECTURES)
def test_export_loads_in_transformers_with_trainyards_logits(world, name):
    from trainyard.parallel.io.export import export_hf, export_model, load_exported
    from transformers import AutoModelForCausalLM

    _, configs, curves, root = world
    cfg = configs[name, "z3"]
    exported = export_model(cfg, checkpoint.step_dir(root / f"{name}-z3", 1), 1, root / f"{name}.safetensors")
    out = export_hf(exported, root / f"{name}-hf")
    theirs, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.eval()
    ours = load_exported(exported).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours.head(ours(tokens))
        if ours.softcap is not None:
            logits = torch.tanh(logits / ours.softcap) * ours.softcap
        torch.testing.assert_close(theirs(tokens).logits, logits, rtol=0, atol=ATOL)
    assert abs(curves[name, "z3"][0][1] - _hf_loss(theirs, cfg, 1)) < ATOL  # the trained state, exported
