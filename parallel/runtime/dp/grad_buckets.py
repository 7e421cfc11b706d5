"""The gradient buckets of `parallel.runtime.dp.data_parallel`'s reducers: their sizes (DDP's two), one bucket's
state, how parameters are split into buckets, and the small steps on a bucket's views (a gradient copied in, the
views settled before a reduction). The reducers' flow and the reasons for it are that module's docstring."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from trainyard.parallel.runtime.tp.local_parts import local_part, own_bucket

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""`parallel.reduce_dtype` -> the type of the gradients on the wire between data-parallel ranks (the buckets' and
FSDP2's reductions alike)."""
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size
FIRST_BUCKET_BYTES = 1024 * 1024
"""Each chunk's first bucket (its last layers' gradients, final first in backward) is at most this (DDP's
`_DEFAULT_FIRST_BUCKET_BYTES`): its reduction starts early in backward, not once a whole BUCKET_BYTES is in."""


@dataclass
class Bucket:
    chunk: int
    params: list[nn.Parameter]
    flat: torch.Tensor
    """Every parameter's gradient, back to back (padded to a multiple of the group size)."""
    offsets: list[int]
    grads: list[torch.Tensor]
    """Each parameter's view into `flat`, shaped as its `.grad` (a DTensor with the parameter's placements for a
    DTensor parameter): its `.grad` once its first gradient of the step has landed."""
    shard: torch.Tensor | None = None
    """ZeRO-1: the summed gradients of this rank's slice of `flat`."""
    pending: int = 0
    """Parameters whose final gradient has not arrived yet in the armed backward."""
    landed: int = 0
    """Parameters whose gradient is in `flat` this step (the rest have none yet)."""
    work: dist.Work | None = None
    wire: torch.Tensor | None = None
    """The reduced-precision copy on the wire (reduce_dtype bf16), written back to fp32 after the wait."""
    slices: list[tuple[nn.Parameter, int, int, int]] = field(default_factory=list)
    """ZeRO-1: (parameter, start in the parameter, start in the shard, length) of each piece in the shard."""
    pieces: list[torch.Tensor] = field(default_factory=list)
    """ZeRO-1: each slice as a view of its parameter's data, the tensors the optimizer updates."""


def copy_grad(view: torch.Tensor, grad: torch.Tensor) -> None:
    """`grad` into its bucket view. A DTensor gradient is first brought to the view's placements, as autograd's
    `grad += new` would (a sequence-parallel norm's partial sum all-reduced over tp, a vocabulary-parallel
    embedding's whole gradient sliced to this rank's rows)."""
    if isinstance(view, DTensor):
        if isinstance(grad, DTensor) and grad.placements != view.placements:
            grad = grad.redistribute(view.device_mesh, view.placements)
        grad = local_part(grad)
        view = view.to_local()
    view.copy_(grad)


@torch.no_grad()
def settle(b: Bucket) -> None:
    """Before a bucket's reduction, each parameter whose gradient is not in the bucket yet: zeros in its view if
    it got none this step, else (set as `.grad` by hand, not by autograd's accumulation) its gradient."""
    for p, view in zip(b.params, b.grads, strict=True):
        if p.grad is None:
            local_part(view).zero_()
        elif p.grad is not view:
            copy_grad(view, p.grad)
        p.grad = view
    b.landed = len(b.params)


def shard_of(b: Bucket) -> torch.Tensor:
    assert b.shard is not None  # ZeRO-1's `_make_bucket` gives every bucket its slice
    return b.shard


def grad_of(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # after `finish`: its bucket view (`_settle` set it where no gradient came)
    return p.grad


def split(params: list[nn.Parameter], bucket_bytes: int,
           first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> list[list[nn.Parameter]]:
    buckets: list[list[nn.Parameter]] = [[]]
    size, kind = 0, None
    for p in params:
        shard = local_part(p)
        nbytes = shard.numel() * shard.element_size()
        key = (shard.dtype, shard.device, id(p) if own_bucket(p) else None)  # a tied copy alone: sliced alike
        cap = min(bucket_bytes, first_bucket_bytes) if len(buckets) == 1 else bucket_bytes
        if buckets[-1] and (size + nbytes > cap or key != kind):
            buckets.append([])
            size = 0
        kind = key
        buckets[-1].append(p)
        size += nbytes
    return [b for b in buckets if b]
