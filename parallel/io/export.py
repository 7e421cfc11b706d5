"""The trained model as one file: a job's checkpoint consolidated into a safetensors file of the unsharded
model, whatever layout trained it.

The file holds every tensor of `full_model(cfg, seed).state_dict()` under its name (a tied head and
embedding as two equal tensors, since safetensors stores no shared storage), and `__metadata__` holds
`config` (the model config as JSON) and `step`. `load_exported(file)` builds the model from that config and
loads it (strict). Consolidation runs in one process, with DCP reading the checkpoint without a process group.

`export_hf` turns such a file into a Hugging Face directory with the model family's mapping
(`parallel.io.hf_checkpoint.write_hf_dir`), for `trainyard export --format hf`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from trainyard.parallel.config import JobConfig, ModelConfig
from trainyard.parallel.io.checkpoint import MODEL_FILE as MODEL_FILE  # the file export_model writes
from trainyard.parallel.io.hf_checkpoint import DEFAULT_MAX_SHARD_BYTES, write_hf_dir
from trainyard.parallel.models.whole import full_model


def export_model(config: JobConfig, checkpoint_dir: Path, step: int, out: Path) -> Path:
    """Write the checkpoint's weights to `out` (written whole under a temporary name, then renamed)."""
    model = full_model(config.model, config.seed)
    weights = {name: p.detach() for name, p in model.named_parameters()}  # a tied weight once
    dcp.load({"model": weights}, checkpoint_id=checkpoint_dir, no_dist=True)
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"config": json.dumps(asdict(config.model)), "step": str(step)})
    os.replace(tmp, out)
    return out

def exported_config(path: Path) -> tuple[ModelConfig, int]:
    """The model config and step an exported file records in its metadata."""
    from pydantic import TypeAdapter  # here: the training path (a rank, bench.gpu) runs with torch alone

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    return TypeAdapter(ModelConfig).validate_python(json.loads(metadata["config"])), int(metadata["step"])

def load_exported(path: str | Path) -> nn.Module:
    """The trained model of an exported file, for any model the file's config describes (MoE included)."""
    cfg, _ = exported_config(Path(path))
    model = full_model(cfg, 0)
    model.load_state_dict(load_file(str(path)), strict=True)
    return model

def export_hf(path: Path, out: Path, *, tokenizer_from: Path | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """An exported file as a Hugging Face directory `out` (see parallel.io.hf_checkpoint.write_hf_dir); raises
    RuleError naming the model field Hugging Face has no form for."""
    cfg, _ = exported_config(path)
    return write_hf_dir(out, cfg, load_file(str(path)), max_shard_bytes=max_shard_bytes,
                        tokenizer_from=tokenizer_from)
