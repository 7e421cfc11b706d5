"""The trained model as one file: a job's checkpoint consolidated into a safetensors file of the unsharded
model, whatever layout trained it.

The file holds every tensor of `full_model(cfg, seed).state_dict()` under its name (a tied head and
embedding as two equal tensors, since safetensors stores no shared storage), and `__metadata__` holds
`config` (the model config as JSON) and `step`. So `full_model(cfg, seed).load_state_dict(file, strict=True)`
loads it. Consolidation runs in one process, with DCP reading the checkpoint without a process group.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from parallel.config import JobConfig
from parallel.model import full_model

MODEL_FILE = "model.safetensors"


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
