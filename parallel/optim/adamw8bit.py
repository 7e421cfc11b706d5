"""Builds torchao's `AdamW8bit` (block-wise 8-bit AdamW moments) for the optimizer registry
(`parallel.optim.kinds`); kept apart so that only jobs asking for it import torchao.

torchao compiles each tensor's step with `torch.compile`; on CPU that is inductor's C++ build, tens of seconds
per tensor shape, for a step that is memory bound anyway: there the same ops run eagerly
(`torch.compiler.set_stance("force_eager")`), on CUDA compiled as torchao intends.
"""

from __future__ import annotations

import torch
from torchao.optim import AdamW8bit
from trainyard.parallel.config import OptimizerConfig


class EagerOnCpuAdamW8bit(AdamW8bit):
    @torch.no_grad()
    def step(self, closure=None):
        on_cpu = all(p.device.type == "cpu" for g in self.param_groups for p in g["params"])
        if not on_cpu:
            return super().step(closure)
        with torch.compiler.set_stance("force_eager"):
            return super().step(closure)


def adamw8bit(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return EagerOnCpuAdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
