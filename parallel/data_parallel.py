"""Data-parallel gradient synchronisation: a bucketed all-reduce (SUM) run once per step.

Written by hand instead of wrapping stages in DistributedDataParallel because:
- the loss is already normalised by the global token count, so a SUM of gradients is the exact
  gradient of the global batch (DDP averages, which would need the loss rescaled by dp);
- with pipeline schedules a stage's micro-batch backwards interleave with other micro-batches' forwards,
  and DDP would need `no_sync` around all but the last; one reduction after the schedule composes with
  any schedule and keeps one code path for pp = 1 and pp > 1.
The cost is no overlap of the reduction with backward; `make bench` compares against torchrun + DDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size


@torch.no_grad()
def allreduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum every parameter's gradient across `group` (no-op without a group)."""
    if group is None:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(synced)


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if buckets[-1] and (size + nbytes > BUCKET_BYTES or g.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    return [b for b in buckets if b]
