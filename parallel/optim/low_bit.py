"""Builds torchao's low-bit AdamWs for the optimizer registry (`parallel.optim.kinds`): `AdamW8bit` (block-wise
8-bit moments, Dettmers et al. 2021) and `AdamW4bit` (block-wise 4-bit moments, Li et al. 2023, "Memory Efficient
Optimizers with 4-bit States"); kept apart so that only jobs asking for one import torchao.

torchao compiles each tensor's step with `torch.compile`; on CPU that is inductor's C++ build, tens of seconds
per tensor shape, for a step that is memory bound anyway: there the same ops run eagerly
(`torch.compiler.set_stance("force_eager")`), on CUDA compiled as torchao intends.
"""

from __future__ import annotations

import torch
from torchao.optim import AdamW4bit, AdamW8bit
from trainyard.parallel.config import OptimizerConfig


class _EagerOnCpu(torch.optim.Optimizer):
    """A torchao optimizer's step, run eagerly when every parameter is on the CPU."""

    @torch.no_grad()
    def step(self, closure=None):
        on_cpu = all(p.device.type == "cpu" for g in self.param_groups for p in g["params"])
        if not on_cpu:
            return super().step(closure)
        with torch.compiler.set_stance("force_eager"):
            return super().step(closure)


class EagerOnCpuAdamW8bit(_EagerOnCpu, AdamW8bit):
    pass


class EagerOnCpuAdamW4bit(_EagerOnCpu, AdamW4bit):
    pass


def adamw8bit(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return EagerOnCpuAdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)


def adamw4bit(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return EagerOnCpuAdamW4bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
