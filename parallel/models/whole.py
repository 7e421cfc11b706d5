"""The whole model of a job, whatever its family (kept so `parallel.models.whole.full_model` stays the one call).

The families live in `parallel.models`; `GPTStage` and `init_parameters` are re-exported for the code that
names them.
"""

from __future__ import annotations

from torch import nn
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models import family_of
from trainyard.parallel.models.components.decoder import DecoderStage, init_parameters
from trainyard.parallel.models.gpt2.model import GPTStage


def full_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The unsharded model: one stage holding everything."""
    return family_of(cfg).build_stage(cfg, range(cfg.n_layer), first=True, last=True, seed=seed)


__all__ = ["DecoderStage", "GPTStage", "full_model", "init_parameters"]
