"""One rank's sampler: a built model's generation (`generate` over `kv_cache`) at its live weights or at a named
snapshot of them (`snapshots`), for the Tinker-compatible API's sampling clients (`parallel.runtime.open_loop`
holds one).

A sample's request is checked again here (`params.sample_call`, a `SampleError` naming the field); its stop tokens
are the request's or the model's implicit ones (`params.implicit_stop_tokens`: its EOS), its stop strings read with
the model directory's tokenizer (loaded at the first request that gives one). The model runs in eval mode for the
sample (LoRA's dropout off) and goes back to the mode it was in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from trainyard.parallel.runtime.sampling.generate import generate, stop_strings
from trainyard.parallel.runtime.sampling.kv_cache import Autocast, cached_model
from trainyard.parallel.runtime.sampling.params import has_tokenizer, implicit_stop_tokens, sample_call
from trainyard.parallel.runtime.sampling.snapshots import Snapshots


class Sampler:
    """`stage`: the whole model (first and last); `directory`: its Hugging Face directory (EOS, tokenizer), or
    None; `seq_len`, `vocab_size`: what a request must fit."""

    def __init__(self, stage: nn.Module, device: torch.device, seq_len: int, vocab_size: int,
                 directory: str | Path | None = None, autocast: Autocast = contextlib.nullcontext):
        self.stage, self.device, self.autocast = stage, device, autocast
        self.seq_len, self.vocab_size, self.directory = seq_len, vocab_size, directory
        self.snapshots = Snapshots(stage)
        self.eos = implicit_stop_tokens(directory)
        self._tokenizer: Any = None

    def save(self, name: str, drop: Sequence[str] = ()) -> dict[str, Any]:
        """Snapshot the trainable weights under `name`, forgetting the snapshots named in `drop`."""
        for old in drop:
            self.snapshots.drop(old)
        self.snapshots.save(name)
        return {"name": name, "kept": len(self.snapshots.saved)}

    def sample(self, request: dict[str, Any], name: str | None = None) -> dict[str, Any]:
        """`request`: the SDK's SampleRequest as plain data (its prompt a flat list of ids); `name`: the snapshot
        to sample (None: the live weights). The answer of `generate.generate`, with `type` "sample"."""
        call = sample_call(request, self.seq_len, self.vocab_size, has_tokenizer(self.directory))
        stop_text = None
        if call.stop_strings:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(self.directory))
            stop_text = stop_strings(self._tokenizer, call.stop_strings)
        stops = self.eos if call.stop_tokens is None else call.stop_tokens
        training = self.stage.training
        self.stage.eval()
        try:
            with self.snapshots.swapped_in(name):
                out = generate(cached_model(self.stage, self.autocast), call, self.device, stops, stop_text)
        finally:
            self.stage.train(training)
        return {"type": "sample", **out}
