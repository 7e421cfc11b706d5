"""The optimizer (the spec's `optimizer.kind`, from `parallel.optim.kinds`), setting its learning rate (the schedule
is `parallel.optim.lr_schedules.lr_at`) and global-norm gradient clipping.

Clipping is written here rather than taken from `torch.nn.utils.clip_grad_norm_` because each rank holds
only part of the gradients (its pipeline stage, its tp shards, its experts, its ZeRO-1 slice), some of
them also held by other ranks: the squared norm is a weighted sum over every rank (see `clip_grad_norm`).
It works on plain local tensors: a tensor-parallel stage mixes DTensor and plain gradients, which torch's
foreach kernels refuse in one list.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from trainyard.parallel.config import OptimizerConfig
from trainyard.parallel.optim.kinds import optimizer_kind


def make_optimizer(params: Iterable[tuple[torch.Tensor, nn.Parameter]],
                   cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The spec's optimizer (`optimizer.kind`; the trainer's, with offload and factored pieces, is
    `parallel.runtime.train_optimizer`'s) over (tensor to update, the parameter it belongs to) pairs: the parameters
    themselves, or with ZeRO-1 this rank's pieces of them. Weight decay on matrices and embeddings only (not
    on biases and norm gains), as the owning parameter's shape says.

    Tensor-parallel (DTensor) and plain tensors go in separate groups: the foreach kernels refuse a list that
    mixes the two, and a tensor-parallel stage keeps some plain ones (wpe, and the norms without sp).
    """
    params = list(params)
    groups = []
    for decay in (True, False):
        for sharded in (False, True):
            chosen = [t for t, p in params if (p.dim() >= 2) == decay and isinstance(t, DTensor) == sharded]
            if chosen:
                groups.append({"params": chosen, "weight_decay": cfg.weight_decay if decay else 0.0})
    return optimizer_kind(cfg).build(groups, cfg)


class HasParamGroups(Protocol):
    """A torch optimizer, or an object stepping several (`parallel.runtime.train_optimizer.TrainOptimizer`)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


def set_lr(optimizer: HasParamGroups, lr: float) -> None:
    """Every group's learning rate (torchao's optimizers keep it as a tensor, to be filled in place)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


@torch.no_grad()
def clip_grad_norm(grads: list[tuple[torch.Tensor, float]], max_norm: float,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global norm of gradients spread over the ranks of `group`; scales them all if it is above max_norm.

    Each entry is a plain tensor of this rank's gradients and its weight, 1 / (the number of ranks of the
    group that hold an identical copy of it): a tensor-parallel shard is held once, a replicated parameter
    by every tp rank, a data-parallel gradient by every dp replica unless ZeRO-1 split it. The weighted sums
    of squares add up over `group` (None: this rank holds everything) to every distinct gradient counted
    once, whatever the layout. Returns the norm as a tensor: reading it waits for the device, which the
    caller does once the step's work is queued.
    """
    device = grads[0][0].device if grads else "cpu"
    sq = torch.zeros((), device=device)
    for weight in sorted({w for _, w in grads}):
        sq += weight * _sum_of_squares([g for g, w in grads if w == weight], device)
    if group is not None:
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    if max_norm > 0 and grads:
        torch._foreach_mul_([g for g, _ in grads], torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def tp_copies(p: torch.Tensor, tp: int) -> int:
    """How many tp ranks hold an identical copy of a parameter's local gradient: 1 if it is sharded over tp."""
    return 1 if isinstance(p, DTensor) and _is_sharded(p) else tp


def _is_sharded(t: DTensor) -> bool:
    return any(p.is_shard() for p in t.placements)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), device=device)
    return torch.stack(torch._foreach_norm(tensors)).pow(2).sum()
