"""README's fine-tuning walk-through, run as written through the real service (uvicorn, Ray, gloo): the blocks
marked `<!-- run by tests/e2e/test_finetune_walkthrough.py -->` prepare the chat records, submit
examples/finetune.yaml (LoRA from an `init_from` base, whole examples, epochs, dp=2) with `trainyard submit`,
follow it, print its metrics, export the adapter with `--format peft` over HTTP, and load it in peft onto the base.

The base that README's pretraining would export to exported/tiny-llama is built here instead (a tiny
LlamaForCausalLM of the examples' 1024-id vocabulary, and the examples' tokenizer), so the run takes seconds. The
job's whole examples are each seen once per epoch at dp=2, its metrics print the epoch and val_loss columns, and the
adapter peft loads gives the logits of trainyard's own export of the job.

In `make test-slow`, not `make test`: five CLI processes (`prepare --chat` imports transformers), a Ray job of a
coordinator and two ranks and peft take about 35 s on a loaded 2-core machine (5 s of the CLI's CPU alone), more
than `make test`'s headroom; the adapters' numbers are `make test`'s in tests/integration/test_hf_gloo.py."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from collections import Counter

import pytest
import torch
from helpers import REPO, SLOW
from hf_tiny import tiny_llama

MARKER = "<!-- run by tests/e2e/test_finetune_walkthrough.py -->"
pytestmark = SLOW


def readme_blocks() -> dict[str, str]:
    """The marked blocks by language: {"bash": ..., "python": ...}."""
    found = re.findall(rf"^{re.escape(MARKER)}\n```(bash|python)\n(.*?)^```", (REPO / "README.md").read_text(),
                       re.M | re.S)
    assert sorted(lang for lang, _ in found) == ["bash", "python"], found
    return dict(found)


@pytest.fixture(scope="module")
def walkthrough(service, tmp_path_factory):
    """The bash block run in a fresh directory standing for the repository root: (directory, its output)."""
    work, bin_dir = tmp_path_factory.mktemp("checkout"), tmp_path_factory.mktemp("bin")
    (work / "examples").symlink_to(REPO / "examples")
    base = tiny_llama(work / "exported" / "tiny-llama", vocab_size=1024)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # as `export --format hf` of a prepared job writes
        shutil.copy(REPO / "examples" / "tokenizer" / name, work / "exported" / "tiny-llama" / name)
    shim = bin_dir / "trainyard"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m trainyard.cli.main "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(REPO),
           "TRAINYARD_URL": service.url, "TRAINYARD_TOKEN": service.token}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", readme_blocks()["bash"]], cwd=work, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"README's fine-tuning block failed:\n{done.stdout}\n{done.stderr}"
    return work, base, done.stdout


def test_the_walkthrough_trains_lora_on_whole_examples_for_its_epochs(walkthrough, client):
    work, _, out = walkthrough
    job = next(j for j in client.jobs() if j["name"] == "tiny-llama-chat" and j["status"] == "SUCCEEDED")
    rows = client.metrics(job["job_id"])
    ids = [i for r in rows for i in r["sample_ids"]]
    per_epoch = max(ids) + 1  # sequences: the training examples, those longer than seq_len in pieces
    # the spec's steps: 1000, lowered at submit to the step that ends the third epoch
    assert len(rows) == job["steps"] == math.ceil(3 * per_epoch / 8)
    for epoch in range(3):  # each sequence exactly once in each epoch (the last step's batch runs into a 4th)
        assert Counter(ids[epoch * per_epoch:(epoch + 1) * per_epoch]) == Counter(range(per_epoch))
    assert rows[-1]["loss"] < rows[0]["loss"]
    header = next(line for line in out.splitlines() if line.lstrip().startswith("step"))
    assert header.split()[:4] == ["step", "epoch", "loss", "val_loss"]
    assert (work / "exported" / "tiny-llama-chat-lora" / "adapter_model.safetensors").is_file()


def test_the_exported_adapter_loads_in_peft_with_trainyards_logits(walkthrough, client, service, tmp_path,
                                                                   monkeypatch, capsys):
    from trainyard.cli.main import main as cli
    from trainyard.parallel.io.export import load_exported

    work, base, _ = walkthrough
    job = next(j for j in client.jobs() if j["name"] == "tiny-llama-chat" and j["status"] == "SUCCEEDED")
    monkeypatch.chdir(work)  # README's block uses paths relative to the repository root
    scope: dict = {}
    exec(readme_blocks()["python"], scope)  # noqa: S102 - README's own code, as a reader would run it
    assert "<|assistant|>" in capsys.readouterr().out
    assert cli(["--url", service.url, "--token", service.token, "export", job["job_id"], "-o", str(tmp_path)]) == 0
    ours = load_exported(tmp_path / "model.safetensors")
    tokens = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.lm_head(ours.ln_f(ours(tokens)))
        assert (expected - base(tokens).logits).abs().max() > 1e-4  # the adapters moved off B = 0
        torch.testing.assert_close(scope["model"](tokens).logits, expected, rtol=0, atol=1e-5)
