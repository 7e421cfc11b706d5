"""`trainyard generate --model DIR` (`cli.generate`), in this process: a Hugging Face directory with a tokenizer
samples a text prompt greedily as transformers' `generate` does, token for token (the model's EOS ending both
alike); seeded samples reproduce; a bad setting names its flag; a prompt as text needs a tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from hf_tiny import tiny_llama
from trainyard.cli.main import main

TOKENIZER = Path(__file__).parents[2] / "examples" / "tokenizer"


def test_generate_samples_a_model_directory_as_transformers_does(tmp_path, capsys):
    from transformers import AutoTokenizer

    theirs = tiny_llama(tmp_path / "m", vocab_size=1024).eval()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, tmp_path / "m" / name)
    prompt = AutoTokenizer.from_pretrained(tmp_path / "m")("the yard", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "the yard", "--max-tokens", "12",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"] == prompt and out["sequences"][0]["tokens"] == expected.tolist()
    seeded = ["generate", "--model", str(tmp_path / "m"), "--tokens", "5,6,7", "--temperature", "1", "--seed", "4",
              "--num-samples", "2", "--max-tokens", "6", "--stop", "--json"]
    assert main(seeded) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(seeded) == 0
    assert json.loads(capsys.readouterr().out) == first
    assert [len(s["tokens"]) for s in first["sequences"]] == [6, 6]  # --stop with none: only the length ends them
    assert main(["generate", "--model", str(tmp_path / "m"), "--tokens", "5", "--top-p", "2"]) == 2
    assert "--top-p" in capsys.readouterr().err
    (tmp_path / "m" / "tokenizer.json").unlink()
    (tmp_path / "m" / "tokenizer_config.json").unlink()
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "the yard"]) == 2
    assert "--tokens" in capsys.readouterr().err
