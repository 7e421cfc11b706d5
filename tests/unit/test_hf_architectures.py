"""Any causal LM, exactly: tiny models of transformers' own `AutoModelForCausalLM` architectures, each taken as a
new user would (`init_from.hf` of a saved directory, read at submit), either trained exactly or refused at submit
naming why, in this process (no Ray).

Exactly: the job's first loss is transformers' own on the same tokens (1e-5); for the transformers backend the
stage's logits are the model's own forward's (a transform a new transformers version adds to a head fails here);
after one training step through the job's loss, the model exported as a Hugging Face directory loads in
transformers with no key missing or unexpected, and its loss there is the job's own on held-out tokens (the job's
`val_loss`). A refusal must be one `REFUSED` expects: a new one (or one gone) fails.

`make test` runs one architecture per kind of difference (`REPRESENTATIVES`); `make test-slow` every architecture of
the registry that transformers builds at tiny sizes (the others are skipped, naming transformers' error).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import slow, tiny_spec
from hf_tiny import tiny_architecture
from trainyard.api.spec import parse_submitted_spec
from trainyard.parallel.io.hf_checkpoint import load_into, write_hf_dir
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.spec import SpecError

TOL = 1e-5

REPRESENTATIVES = {
    "gpt_neox": "its head is `embed_out` in a checkpoint, `lm_head` in memory",
    "granite": "embedding, residual and attention multipliers; logits / logits_scaling",
    "gemma2": "final logit soft-capping, tied embeddings, a sliding window",
    "cohere": "logits * logit_scale",
    "opt": "its body (OPTModel) holds the decoder (get_decoder) one level down; dropout 0.1 by default",
    "olmoe": "refused: its checkpoints store each expert apart",
}
"""One architecture per kind of difference from a plain Llama, for `make test`."""

CONVERTED = "tensors transformers converts as it loads them"  # experts one tensor each, stacked on load; fused convs
BUFFERS = "buffers transformers loads with the weights"  # the backend computes its buffers as it builds the model
LAYERS = "decoder layers (transformers' GradientCheckpointingLayer"  # none, or not num_hidden_layers of them
APART = "its head cannot run apart from its body"  # it calls .item() on a tensor (no meta trace)
REFUSED = {
    **dict.fromkeys(["bailing_hybrid", "cohere2_moe", "flex_olmo", "hrm_text", "hunyuan_v1_moe", "jamba",
                     "olmo_hybrid", "olmoe", "phimoe"], CONVERTED),
    **dict.fromkeys(["apertus", "apertus1p5_text", "gemma4_unified_text", "minimax", "minimax_m2",
                     "minimax_m3_vl_text"], BUFFERS),
    **dict.fromkeys(["blenderbot-small", "cpmant", "ctrl", "gpt_neox_japanese", "openai-gpt", "xlm"], LAYERS),
    "modernbert-decoder": APART,
}
"""Architecture -> what its 422 at submit says: the architectures of transformers 5.24's registry, built at tiny
sizes, that the backend cannot train exactly (measured by `make test-slow`)."""


def _registry() -> list[str]:
    """transformers' AutoModelForCausalLM architectures (their model_type), read as the tests are collected."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # the tests that need it fail on their own
        return []
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _their_logits(model, inputs: torch.Tensor) -> torch.Tensor:
    """transformers' forward as it trains (no cache: one architecture, Dory, attends over its cache's past)."""
    with torch.no_grad():
        return model(inputs, use_cache=False).logits


def _their_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float(F.cross_entropy(_their_logits(model, inputs).flatten(0, 1), targets.flatten()))


def _our_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model.loss_sum(model(inputs), targets) / targets.numel()


def check_architecture(model_type: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    try:
        source = tiny_architecture(model_type, tmp_path / "src")
    except Exception as e:  # noqa: BLE001 - transformers' own limits at these sizes: not the backend's
        pytest.skip(f"transformers does not build {model_type} at tiny sizes: {e!r}"[:300])
    spec = tiny_spec(init_from={"hf": str(tmp_path / "src")}, global_batch=4)
    spec["model"] = {"seq_len": 16}
    try:
        config = parse_submitted_spec(spec)
        make_plan(config)
    except (SpecError, PlanError) as e:  # refused at submit: it must say why, as REFUSED expects
        assert model_type in REFUSED, f"{model_type} refused at submit: {e}"
        assert REFUSED[model_type] in str(e), str(e)
        return
    assert model_type not in REFUSED, f"{model_type} is no longer refused ({config.model.family})"
    cfg = config.model
    ours = full_model(cfg, seed=0)
    load_into([ours], cfg, tmp_path / "src")
    inputs, targets = _tokens(0)
    first = _our_loss(ours, inputs, targets)
    assert abs(float(first.detach()) - _their_loss(source, inputs, targets)) < TOL, cfg.family
    if cfg.family == "hf":
        with torch.no_grad():
            torch.testing.assert_close(ours.logits(ours(inputs)), _their_logits(source, inputs), rtol=0, atol=TOL)
    first.backward()  # one step through the job's loss: a head the job computed otherwise would now show
    with torch.no_grad():
        for p in ours.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    held_out = _tokens(1)
    with torch.no_grad():
        val_loss = float(_our_loss(ours, *held_out))
    write_hf_dir(tmp_path / "hf", cfg, {name: t.detach() for name, t in ours.state_dict().items()})
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert abs(_their_loss(theirs.eval(), *held_out) - val_loss) < TOL


@pytest.mark.parametrize("model_type", list(REPRESENTATIVES))
def test_each_kind_of_architecture_trains_exactly_or_is_refused_at_submit(model_type, tmp_path):
    check_architecture(model_type, tmp_path)


@slow
@pytest.mark.parametrize("model_type", _registry())
def test_every_architecture_of_the_registry_trains_exactly_or_is_refused_at_submit(model_type, tmp_path):
    check_architecture(model_type, tmp_path)
