"""The trained model as one file: a job's checkpoint consolidated into a safetensors file of the unsharded
model, whatever layout trained it.

The file holds every tensor of `full_model(cfg, seed).state_dict()` under its name (a tied head and
embedding as two equal tensors, since safetensors stores no shared storage), and `__metadata__` holds
`config` (the model config as JSON) and `step`. `load_exported(file)` builds the model from that config and
loads it (strict). Consolidation runs in one process, with DCP reading the checkpoint without a process group.

`export_hf` turns such a file into a Hugging Face directory with the model family's mapping
(`parallel.io.hf_checkpoint.write_hf_dir`), for `trainyard export --format hf`.

A LoRA job (`model.lora`): its checkpoints hold the adapters only, so the export rebuilds the frozen base as
training did (from `init_from.hf`, else the seed) and the file holds base and adapters under their names
(`metadata` `base`: the init_from directory); `export_hf` writes the merged model (W + (alpha / rank) B A) and
`export_peft` the adapters as a PEFT adapter directory (`parallel.io.peft_adapter`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from trainyard.parallel.config import JobConfig, ModelConfig, RuleError
from trainyard.parallel.io.checkpoint import MODEL_FILE as MODEL_FILE  # the file export_model writes
from trainyard.parallel.io.hf_checkpoint import DEFAULT_MAX_SHARD_BYTES, load_into, write_hf_dir
from trainyard.parallel.io.peft_adapter import write_peft_dir
from trainyard.parallel.io.stream_safetensors import Entry, write_streamed
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.models.components.lora import apply_lora, is_adapter, merged
from trainyard.parallel.models.whole import full_model


def export_model(config: JobConfig, checkpoint_dir: Path, step: int, out: Path) -> Path:
    """Write the checkpoint's weights to `out` (written whole under a temporary name, then renamed). Streamed
    (`parallel.io.stream_safetensors`): the model's names and shapes from its meta-device build, the weights read
    from the checkpoint and written about 64 MiB at a time, so the exporting process (a job's rank 0, beside its
    own shards) never holds the whole model; a LoRA job (its base built or read whole anyway) or a model with
    buffers in its state dict is gathered whole first."""
    base = config.init_from.hf if config.init_from is not None else None
    metadata = {"config": json.dumps(asdict(config.model)), "step": str(step)} | ({"base": base} if base else {})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    layout = _stored_names(config.model, config.seed) if config.model.lora is None else None
    if layout is not None:
        entries, stored = layout
        write_streamed(tmp, entries, lambda group: _read(checkpoint_dir, group, stored), metadata)
        os.replace(tmp, out)
        return out
    model = _model(config.model, config.seed)
    if config.model.lora is not None and base is not None:  # the frozen base, which the checkpoint does not hold
        load_into([model], config.model, Path(base))
    weights = {name: p.detach() for name, p in model.named_parameters()  # a tied weight once
               if config.model.lora is None or is_adapter(name)}
    dcp.load({"model": weights}, checkpoint_id=checkpoint_dir, no_dist=True)
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, out)
    return out


def _stored_names(cfg: ModelConfig, seed: int) -> tuple[list[Entry], dict[str, str]] | None:
    """The exported file's tensors (the whole model's state dict: name, shape, dtype) and, for each, the name the
    checkpoint holds it under (a tied weight is one parameter, stored once); None when the state dict holds
    something that is no parameter (a buffer: its value is the model's, not the checkpoint's)."""
    with torch.device("meta"):
        model = full_model(cfg, seed)
    first: dict[int, str] = {}
    stored = {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}
    state = model.state_dict()
    if set(state) - set(stored):
        return None
    return [(name, tuple(t.shape), t.dtype) for name, t in state.items()], stored


def _read(checkpoint_dir: Path, group: Sequence[Entry], stored: dict[str, str]) -> list[torch.Tensor]:
    """The tensors of `group` read from the checkpoint (one DCP load for the group; a tied pair's weight once)."""
    tensors = {stored[name]: torch.empty(shape, dtype=dtype) for name, shape, dtype in group}
    dcp.load({"model": tensors}, checkpoint_id=checkpoint_dir, no_dist=True)
    return [tensors[stored[name]] for name, _, _ in group]


def exported_config(path: Path) -> tuple[ModelConfig, int]:
    """The model config and step an exported file records in its metadata."""
    from pydantic import TypeAdapter  # here: the training path (a rank, bench.gpu) runs with torch alone

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    return TypeAdapter(ModelConfig).validate_python(json.loads(metadata["config"])), int(metadata["step"])

def load_exported(path: str | Path) -> nn.Module:
    """The trained model of an exported file, for any model the file's config describes (MoE included)."""
    cfg, _ = exported_config(Path(path))
    model = _model(cfg, 0)
    model.load_state_dict(load_file(str(path)), strict=True)
    return model

def export_hf(path: Path, out: Path, *, tokenizer_from: Path | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """An exported file as a Hugging Face directory `out` (see parallel.io.hf_checkpoint.write_hf_dir); raises
    RuleError naming the model field Hugging Face has no form for."""
    cfg, _ = exported_config(path)
    state = load_file(str(path))
    if cfg.lora is not None:
        state = merged(state, cfg.lora)
        cfg = replace(cfg, lora=None)
    return write_hf_dir(out, cfg, state, max_shard_bytes=max_shard_bytes, tokenizer_from=tokenizer_from)


def export_peft(path: Path, out: Path) -> Path:
    """A LoRA job's exported file as a PEFT adapter directory `out` (`parallel.io.peft_adapter`) for the base it
    trained on; RuleError when the job has no adapters, or one PEFT has no form for."""
    cfg, _ = exported_config(path)
    if cfg.lora is None:
        raise RuleError("model.lora", "the job trained no LoRA adapters: export it with --format hf or trainyard")
    with safe_open(str(path), "pt") as f:
        base = f.metadata().get("base")
    return write_peft_dir(out, cfg, load_file(str(path)), base=base)


def _model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The whole model, with LoRA's adapters (as training built them) when `cfg.lora` says."""
    model = full_model(cfg, seed)
    if cfg.lora is None:
        return model
    assert isinstance(model, DecoderStage)  # every family's whole model is one stage
    return apply_lora(model, seed=seed)
