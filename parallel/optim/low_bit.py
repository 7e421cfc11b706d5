"""Builds torchao's low-bit AdamWs for the optimizer registry (`parallel.optim.kinds`): `AdamW8bit` (block-wise
8-bit moments, Dettmers et al. 2021) and `AdamW4bit` (block-wise 4-bit moments, Li et al. 2023, "Memory Efficient
Optimizers with 4-bit States"); kept apart so that only jobs asking for one import torchao.

torchao compiles each tensor's step with `torch.compile`; on CPU that is inductor's C++ build, tens of seconds
per tensor shape, for a step that is memory bound anyway: there the same ops run eagerly
(`torch.compiler.set_stance("force_eager")`), on CUDA compiled as torchao intends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchao.optim import AdamW4bit, AdamW8bit
from trainyard.parallel.config import OptimizerConfig


def _eagerly_on_cpu(optimizer: torch.optim.Optimizer, step: Callable, closure: Callable | None):
    """A torchao optimizer's `step`, run eagerly when every parameter is on the CPU."""
    if not all(p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"]):
        return step(closure)
    with torch.compiler.set_stance("force_eager"):
        return step(closure)


class EagerOnCpuAdamW8bit(AdamW8bit):
    @torch.no_grad()
    def step(self, closure=None):
        return _eagerly_on_cpu(self, super().step, closure)


class EagerOnCpuAdamW4bit(AdamW4bit):
    @torch.no_grad()
    def step(self, closure=None):
        return _eagerly_on_cpu(self, super().step, closure)


def adamw8bit(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return EagerOnCpuAdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)


def adamw4bit(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return EagerOnCpuAdamW4bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
