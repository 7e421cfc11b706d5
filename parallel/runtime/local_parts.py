"""A rank's part of a tensor that may be a DTensor (tensor-parallel or FSDP2-sharded), and back: `local_part` and
`like_param`, which the reducers, FSDP2's reducer, the optimizer, the replica sync and the rank's state all need.
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
