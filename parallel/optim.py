"""AdamW, the learning-rate schedule and global-norm gradient clipping.

Clipping is written here rather than taken from `torch.nn.utils.clip_grad_norm_` because with pipeline
parallelism each rank holds only its stage's parameters: the squared norm must be summed across the
pipeline group before the clip coefficient is known. With tensor parallelism it works on local shards and
sums them over the tp group itself: a tensor-parallel stage mixes DTensor and plain gradients, which torch's
foreach kernels refuse in one list.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.config import OptimizerConfig


def make_optimizer(modules: Iterable[nn.Module], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (not on biases and norm gains).

    Tensor-parallel (DTensor) and plain parameters go in separate groups: the foreach kernels refuse a list
    that mixes the two, and a tensor-parallel stage keeps some plain ones (wpe, and the norms without sp).
    """
    params = [p for m in modules for p in m.parameters()]
    groups = []
    for decay in (True, False):
        for sharded in (False, True):
            chosen = [p for p in params if (p.dim() >= 2) == decay and isinstance(p, DTensor) == sharded]
            if chosen:
                groups.append({"params": chosen, "weight_decay": cfg.weight_decay if decay else 0.0})
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
def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None,
                   tp_group: dist.ProcessGroup | None = None, *, experts: list[nn.Parameter] | None = None,
                   ep_group: dist.ProcessGroup | None = None) -> float:
    """Global gradient norm over every stage's parameters; scales grads if above max_norm.

    A tensor-parallel parameter sharded over tp contributes the squares of its local shard, summed over
    `tp_group`; a replicated one (a plain tensor, or a DTensor replicated over tp) is counted once, since
    every tp rank holds the same whole gradient. The `experts` an expert-parallel rank hosts are its own, so
    their squares are summed over `ep_group` (its tp peers hold the same experts and are not counted again).
    Then the stages' sums add up over `pp_group`. Data-parallel replicas hold equal gradients after their
    reduction, so dp needs no reduction here.
    """
    grads = [(g.to_local(), _is_sharded(g)) if isinstance(g, DTensor) else (g, False)
             for g in (p.grad for p in params) if g is not None]
    expert_grads = [p.grad for p in experts or [] if p.grad is not None]
    device = grads[0][0].device if grads else "cpu"
    sharded, replicated = (_sum_of_squares([g for g, s in grads if s == want], device) for want in (True, False))
    hosted = _sum_of_squares(expert_grads, device)
    if tp_group is not None:
        dist.all_reduce(sharded, group=tp_group)
    if ep_group is not None:
        dist.all_reduce(hosted, group=ep_group)
    sq = sharded + replicated + hosted
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt()
    if max_norm > 0 and (grads or expert_grads):
        torch._foreach_mul_([g for g, _ in grads] + expert_grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm)


def _is_sharded(t: DTensor) -> bool:
    return any(p.is_shard() for p in t.placements)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), device=device)
    return torch.stack(torch._foreach_norm(tensors)).pow(2).sum()
