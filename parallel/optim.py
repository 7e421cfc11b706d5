"""AdamW, the learning-rate schedule and global-norm gradient clipping.

Clipping is written here rather than taken from `torch.nn.utils.clip_grad_norm_` because with pipeline
parallelism each rank holds only its stage's parameters: the squared norm must be summed across the
pipeline group before the clip coefficient is known.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from parallel.config import OptimizerConfig


def make_optimizer(modules: Iterable[nn.Module], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (not on biases and norm gains)."""
    params = [p for m in modules for p in m.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float, group: dist.ProcessGroup | None) -> float:
    """Global gradient norm over every stage's parameters (summed across `group`); scales grads if above max_norm."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
    else:
        sq = torch.zeros((), device=params[0].device if params else "cpu")
    if group is not None:
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    if max_norm > 0 and grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm)
