"""Tiny tokenizers built in-test (nothing downloaded), and preparing the examples with them."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import REPO

EOS = "<|endoftext|>"
SPECIAL = [EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def chat_template() -> str:
    """The chat template the examples' tokenizer carries (examples/tokenizer/tokenizer_config.json)."""
    return json.loads((REPO / "examples" / "tokenizer" / "tokenizer_config.json").read_text())["chat_template"]


def bpe_tokenizer(directory: Path, vocab_size: int = 300, texts: list[str] | None = None,
                  config: bool = True) -> Path:
    """A byte-level BPE trained on examples/corpus.txt (or `texts`), saved as directory/tokenizer.json, with a
    tokenizer_config.json (EOS and the examples' chat template) unless `config` is False."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts or [(REPO / "examples" / "corpus.txt").read_text()], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config:
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": EOS, "chat_template": chat_template(), "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def word_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A whitespace word-level tokenizer from a vocabulary dict: `w0 ... w{n-1}`, EOS last (id vocab_size - 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {EOS: vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return directory


def examples_loss(hf, ds, rows: list[int]) -> float:
    """transformers' loss (`hf`, a causal LM) on each example (piece) of these packed rows of `ds` (a
    `PackedDataset`) run alone, its uncounted targets at -100: the per-example summed losses over all the counted
    targets (what trainyard reports on a packed batch)."""
    import torch

    total, counted = 0.0, 0
    with torch.no_grad():
        for r in rows:
            for k in range(int(ds.rows[r]), int(ds.rows[r + 1])):
                a, b = int(ds.starts[k]), int(ds.stops[k])
                tokens = torch.as_tensor(ds.tokens[a:b].astype("int64"))[None]
                labels = tokens.clone()
                if ds.mask is not None:
                    labels[0, 1:][~torch.as_tensor(ds.mask[a + 1:b].astype(bool))] = -100
                n = int((labels[0, 1:] != -100).sum())
                if n:
                    total += hf(input_ids=tokens, labels=labels).loss.item() * n
                    counted += n
    return total / counted
