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

Tensor-parallel parameters are DTensors: a bucket holds each one's local shard, and its `.grad` is a
DTensor with the parameter's placements over that view. Autograd accumulates a DTensor gradient in place
(`grad += new`), and DTensor first brings `new` to the gradient's placements: a vocabulary-parallel
embedding's gradient (computed whole, DTensor has no row-sharded embedding backward) is sliced to this
rank's rows, and a sequence-parallel norm's gradient (a partial sum over this rank's tokens) is
all-reduced over tp. So after the schedule every local gradient is complete over tp, and the data-parallel
all-reduce sums shards that line up, since dp peers hold the same tp coordinate. (Megatron defers the
norms' tp all-reduce to one per step; here it is one small all-reduce per norm parameter and micro-batch.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size


class GradientBuckets:
    """Flat gradient buffers for `params`, with each `p.grad` a view into one of them.

    Keep the views: zero gradients with `zero()`, never set them to None. (`optimizer.zero_grad` cannot
    zero them either once DTensor and plain gradients mix: its foreach kernel refuses the mixed list.)
    """

    @torch.no_grad()
    def __init__(self, params: list[nn.Parameter], bucket_bytes: int = BUCKET_BYTES):
        self.buckets: list[torch.Tensor] = []
        for group in _group(params, bucket_bytes):
            first = _local(group[0])
            flat = torch.zeros(sum(_local(p).numel() for p in group), dtype=first.dtype, device=first.device)
            offset = 0
            for p in group:
                shard = _local(p)
                view = flat[offset:offset + shard.numel()].view_as(shard)
                p.grad = view if not isinstance(p, DTensor) else DTensor.from_local(
                    view, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
                offset += shard.numel()
            self.buckets.append(flat)

    @torch.no_grad()
    def zero(self) -> None:
        for flat in self.buckets:
            flat.zero_()

    @torch.no_grad()
    def allreduce(self, group: dist.ProcessGroup | None) -> None:
        """Sum every gradient across `group` (no-op without a group)."""
        if group is None:
            return
        for flat in self.buckets:
            dist.all_reduce(flat, group=group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _group(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    buckets: list[list[nn.Parameter]] = [[]]
    size, kind = 0, None
    for p in params:
        shard = _local(p)
        nbytes = shard.numel() * shard.element_size()
        if buckets[-1] and (size + nbytes > bucket_bytes or (shard.dtype, shard.device) != kind):
            buckets.append([])
            size = 0
        kind = (shard.dtype, shard.device)
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]
