"""(`make test-slow`: `make test` starts from a Hugging Face directory through the service in test_tinker_sdk.py, and
checks these numbers on gloo ranks in tests/integration/test_hf_gloo.py.) The flagship of Hugging Face checkpoints
through the real service (uvicorn, Ray, gloo): a job started from a GPT2LMHeadModel directory with `init_from`,
trained a few steps, exported with `trainyard export --format hf` (the REST path), loads in transformers with no
missing or unexpected keys and gives the logits of trainyard's own export, and `trainyard generate` samples it
greedily as transformers' `generate` does; its first loss is transformers' loss on the same batch. Beside it
(submitted at once, so the two run together), the transformers backend's flagship: a GraniteForCausalLM with its
multipliers and logits scaling, which no native family reads, trained at dp2 with ZeRO-3 and per-layer recompute,
with the same checks, its `val_loss` that of its export in transformers, and its `init_from` event naming the
backend."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from helpers import slow, tiny_spec, wait_terminal
from hf_tiny import hf_val_loss, tiny_backend, tiny_gpt2
from trainyard.api.spec import parse_submitted_spec
from trainyard.cli.main import main as cli
from trainyard.parallel.data.datasets import load_batch, open_dataset
from trainyard.parallel.data.sampler import global_batch_ids
from trainyard.parallel.io.export import load_exported


@slow
def test_init_from_hf_trains_and_exports_to_transformers(service, client, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    source = tiny_gpt2(tmp_path / "src")  # tied embeddings and gelu_new, as published
    spec = tiny_spec(init_from={"hf": str(tmp_path / "src")}, steps=3, global_batch=4, parallel={"dp": 2})
    spec["model"] = {"seq_len": 16}
    job_id = client.submit(spec)
    backend = _submit_backend_job(client, tmp_path)
    job = wait_terminal(client, job_id)
    assert job["status"] == "SUCCEEDED", job["error"]
    assert job["spec"]["model"]["activation"] == "gelu_tanh" and job["spec"]["model"]["tie_embeddings"]
    [claimed] = [e for e in client.events(job_id) if e["kind"] == "init_from"]
    assert (claimed["family"], claimed["architectures"]) == ("gpt2", ["GPT2LMHeadModel"])

    inputs = _first_loss_is_transformers(client, job_id, spec, source)

    auth = ["--url", service.url, "--token", service.token]
    assert cli([*auth, "export", job_id, "--format", "hf", "-o", str(tmp_path / "hf")]) == 0
    assert "AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out
    assert cli([*auth, "export", job_id, "-o", str(tmp_path / "ty")]) == 0
    # format=peft over HTTP: a job without LoRA has no adapter (a 422 naming model.lora); README's walk-through
    # (tests/e2e/test_finetune_walkthrough.py, make test-slow) exports one and loads it in peft
    assert cli([*auth, "export", job_id, "--format", "peft", "-o", str(tmp_path / "peft")]) == 2
    assert "model.lora" in capsys.readouterr().err and not any((tmp_path / "peft").iterdir())
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # `trainyard generate JOB`: the job's export downloaded and sampled here, greedy as transformers' generate
    assert cli([*auth, "generate", job_id, "--tokens", "3,1,4,1,5", "--max-tokens", "8", "--stop", "--json"]) == 0
    theirs.generation_config.eos_token_id = None  # --stop with none: only the length ends a sequence
    with torch.no_grad():
        greedy = theirs.eval().generate(torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=8, do_sample=False)[0, 5:]
    assert json.loads(capsys.readouterr().out)["sequences"][0]["tokens"] == greedy.tolist()
    ours = load_exported(tmp_path / "ty" / "model.safetensors")  # the hint `trainyard export` prints
    assert not torch.equal(ours.state_dict()["wte.weight"], source.state_dict()["transformer.wte.weight"])
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(inputs).logits, ours.lm_head(ours.ln_f(ours(inputs))),
                                   rtol=0, atol=1e-5)
    _check_backend_job(client, service, tmp_path, *backend)


def _submit_backend_job(client, tmp_path):
    source = tiny_backend("granite", tmp_path / "granite-src")  # multipliers; its head divides by logits_scaling
    spec = tiny_spec(init_from={"hf": str(tmp_path / "granite-src")}, steps=3, global_batch=4,
                     parallel={"dp": 2, "zero": 3}, activation_checkpointing="full", eval={"every": 3, "batches": 1})
    spec["model"] = {"seq_len": 16}
    return client.submit(spec), source, spec


def _check_backend_job(client, service, tmp_path, job_id, source, spec):
    from transformers import AutoModelForCausalLM

    job = wait_terminal(client, job_id)
    assert job["status"] == "SUCCEEDED", job["error"]
    assert job["spec"]["model"]["family"] == "hf"
    [event] = [e for e in client.events(job_id) if e["kind"] == "init_from"]
    assert (event["family"], event["architectures"]) == ("hf", ["GraniteForCausalLM"])
    inputs = _first_loss_is_transformers(client, job_id, spec, source)

    auth = ["--url", service.url, "--token", service.token]
    assert cli([*auth, "export", job_id, "--format", "hf", "-o", str(tmp_path / "granite-hf")]) == 0
    assert cli([*auth, "export", job_id, "-o", str(tmp_path / "granite-ty")]) == 0
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path / "granite-hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.eval()
    ours = load_exported(tmp_path / "granite-ty" / "model.safetensors").eval()
    assert not torch.equal(ours.state_dict()["model.embed_tokens.weight"], source.model.embed_tokens.weight)
    with torch.no_grad():
        logits = ours.logits(ours(inputs))  # the model's own head: Granite's logits / logits_scaling
        torch.testing.assert_close(theirs(inputs).logits, logits, rtol=0, atol=1e-5)
    # the job trained and evaluated the model transformers defines (seen: val_loss 3.917, the export's 5.338)
    val_loss = client.metrics(job_id)[-1]["val_loss"]
    assert abs(val_loss - hf_val_loss(theirs, parse_submitted_spec(spec))) < 1e-5


def _first_loss_is_transformers(client, job_id: str, spec: dict, source) -> torch.Tensor:
    """Asserts the job's first loss (global batch 4) equals transformers' own forward of `source` on the same batch;
    returns that batch's inputs."""
    config = parse_submitted_spec(spec)
    inputs, targets = load_batch(open_dataset(config), global_batch_ids(config.seed, 0, 4,
                                                                        open_dataset(config).num_samples))
    with torch.no_grad():
        expected = float(F.cross_entropy(source(inputs).logits.flatten(0, 1), targets.flatten()))
    assert abs(client.metrics(job_id)[0]["loss"] - expected) < 1e-5
    return inputs
