"""Process-group setup for one rank: the default group plus the plan's dp and pp subgroups.

Every rank must call `new_group` for every group, in the same order, even groups it is not in; that is
why all groups are created here in one loop over the plan's group lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel.plan import Plan


@dataclass
class RankGroups:
    """The process groups one rank talks on. A group is None when the rank is alone in it."""

    rank: int
    dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    pp_ranks: list[int]
    """Global ranks of this rank's pipeline, in stage order (index = pp coordinate)."""


def pick_device(gpus_per_worker: int) -> torch.device:
    return torch.device("cuda", 0) if gpus_per_worker > 0 and torch.cuda.is_available() else torch.device("cpu")


def init_distributed(plan: Plan, rank: int, master_addr: str, master_port: int, device: torch.device,
                     timeout_s: float) -> RankGroups:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=plan.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    mine: dict[str, dist.ProcessGroup | None] = {"dp": None, "pp": None}
    pp_ranks = [rank]
    for kind, groups in (("dp", plan.dp_groups()), ("pp", plan.pp_groups())):
        for ranks in groups:
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine[kind] = group
                if kind == "pp":
                    pp_ranks = ranks
    return RankGroups(rank=rank, dp=mine["dp"], pp=mine["pp"], pp_ranks=pp_ranks)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
