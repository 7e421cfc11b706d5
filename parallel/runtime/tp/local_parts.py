"""A rank's part of a tensor that may be a DTensor (tensor-parallel or FSDP2-sharded), and back: `local_part` and
`like_param`, which the reducers, FSDP2's reducer, the optimizer, the replica sync and the rank's state all need;
and `own_bucket`, whether a parameter's part is bucketed alone (so every rank holding a copy slices it alike).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor laid out like parameter `p`: a DTensor with its placements when p is one."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


OWN_BUCKET = "trainyard_own_bucket"
"""The attribute marking a parameter whose gradient the reducers put in a bucket of its own: a tied embedding's
copies (`parallel.runtime.pipeline.tied`), which ZeRO-1 must slice alike on the two ranks holding them."""


def own_bucket(p: torch.Tensor) -> bool:
    return getattr(p, OWN_BUCKET, False)
