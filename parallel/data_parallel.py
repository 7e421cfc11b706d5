"""Data-parallel gradient synchronisation: a bucketed all-reduce (SUM) run once per step.

Written by hand instead of wrapping stages in DistributedDataParallel because:
- the loss is already normalised by the global token count, so a SUM of gradients is the exact
  gradient of the global batch (DDP averages, which would need the loss rescaled by dp);
- with pipeline schedules a stage's micro-batch backwards interleave with other micro-batches' forwards,
  and DDP would need `no_sync` around all but the last; one reduction after the schedule composes with
  any schedule and keeps one code path for pp = 1 and pp > 1.
As DDP's `gradient_as_bucket_view` does, every parameter's `.grad` is a view into a flat bucket kept for
the whole job, so autograd accumulates straight into the buckets and the all-reduce runs in place with
no flatten or copy back. The cost is no overlap of the reduction with backward; `make bench` compares
against torchrun + DDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size


class GradientBuckets:
    """Flat gradient buffers for `params`, with each `p.grad` a view into one of them.

    Keep the views: zero gradients with `optimizer.zero_grad(set_to_none=False)`, never set them to None.
    """

    def __init__(self, params: list[nn.Parameter], bucket_bytes: int = BUCKET_BYTES):
        self.buckets: list[torch.Tensor] = []
        for group in _group(params, bucket_bytes):
            flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device)
            offset = 0
            for p in group:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self.buckets.append(flat)

    @torch.no_grad()
    def allreduce(self, group: dist.ProcessGroup | None) -> None:
        """Sum every gradient across `group` (no-op without a group)."""
        if group is None:
            return
        for flat in self.buckets:
            dist.all_reduce(flat, group=group)


def _group(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and (size + nbytes > bucket_bytes or (p.dtype, p.device) != (buckets[-1][0].dtype,
                                                                                     buckets[-1][0].device)):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]
