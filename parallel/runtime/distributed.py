"""Process-group setup for one rank: the default group plus one DeviceMesh whose dimensions are the plan's axes.

The mesh is the world laid out as (pp, dp, tp), the plan's rank order (tp fastest), so `mesh["tp"]` is this
rank's tensor-parallel group for DTensor and `mesh.get_group("dp")` / `mesh.get_group("pp")` are its data-
and pipeline-parallel groups: one source for every group, created collectively by the mesh (every rank
must create every group, in the same order). With context parallelism the mesh's "dp" dimension is a replica's
dp x cp ranks: they sum the gradients (each cp rank's is its chunks' share of the loss) and share ZeRO's shards.

Mixture-of-experts jobs add three groups the mesh does not hold as dimensions, created with `new_subgroups_
by_enumeration` from the plan's lists: the expert-parallel group (dp ranks that exchange tokens), the
group of ranks holding the same experts (they sum expert gradients: dp replicas and tp ranks), and the
whole stage (router gradients and MoE statistics). Dense jobs create none of them. Context parallelism (cp > 1)
adds the cp group (`Plan.cp_groups`): the ranks splitting the same sequences, which pass key/value blocks round
a ring. A model with tied embeddings
across pipeline ranks adds the pairs holding its first and last virtual stage (`Plan.tied_groups`), which sum the
embedding's and the head copy's gradients (`parallel.runtime.pipeline.tied`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from trainyard.parallel.models.base import ReductionSet
from trainyard.parallel.plan import Plan
from trainyard.parallel.plan.reduction_sets import reduction_groups

MESH_DIMS = ("pp", "dp", "tp")
REPLICA_MESH_DIMS = ("pp", "replica", "dp", "tp")
"""local_sgd and diloco with replicas of several dp ranks (`parallel.sync.replicas`): dp is split in two."""


@dataclass
class RankGroups:
    """The process groups one rank talks on. A group is None when the rank is alone in it."""

    rank: int
    dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    pp_ranks: list[int]
    """Global ranks of this rank's pipeline, in stage order (index = pp coordinate)."""
    tp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    """Context parallelism: the ranks that split this rank's sequences (ring attention), in chunk order."""
    cp_ranks: list[int] | None = None
    """Global ranks of the cp group, index = cp coordinate (None when cp = 1)."""
    tp_mesh: DeviceMesh | None = None
    """The 1-D tensor-parallel mesh DTensor shards over; None when tp = 1."""
    dp_mesh: DeviceMesh | None = None
    """The world mesh's data-parallel dimension of one replica (what FSDP2 shards over at ZeRO-2/3): all of dp but
    with local_sgd and diloco; None when it is one rank."""
    reduce: dist.ProcessGroup | None = None
    """The data-parallel ranks that sum the gradients every step: `dp`, or one local_sgd / diloco replica's."""
    replicas: dist.ProcessGroup | None = None
    """local_sgd, diloco: the ranks holding the same shard in every replica (what a sync averages over)."""
    ep: dist.ProcessGroup | None = None
    """Expert parallelism: the ranks whose experts this rank's tokens may go to."""
    experts: dist.ProcessGroup | None = None
    """The ranks holding this rank's experts (MoE jobs only)."""
    stage: dist.ProcessGroup | None = None
    """Every rank of this rank's pipeline stage (MoE jobs only)."""
    tied: dist.ProcessGroup | None = None
    """This rank and the one holding the other copy of a tied embedding (first and last virtual stage, same dp
    and tp); None when no other rank holds one."""
    checkpoint: dist.ProcessGroup | None = None
    """All ranks, on gloo, for checkpoints only: an async save's collectives run in a background thread and
    must not share a group with the step's."""

    @property
    def reducing(self) -> dict[ReductionSet, dist.ProcessGroup | None]:
        """Each reduction set -> this rank's group that sums its gradients, among the plan's
        (`parallel.plan.reduction_sets.reduction_groups`, which `init_distributed` makes them from)."""
        return {"dense": self.reduce, "router": self.stage, "experts": self.experts}


def pick_device(gpus_per_worker: int) -> torch.device:
    return torch.device("cuda", 0) if gpus_per_worker > 0 and torch.cuda.is_available() else torch.device("cpu")


def init_distributed(plan: Plan, rank: int, master_addr: str, master_port: int, device: torch.device,
                     timeout_s: float, init_method: str | None = None) -> RankGroups:
    """Join the plan's world (rendezvous at rank 0's `master_addr:master_port`, or at `init_method`, e.g. a
    `file://` store that needs no port) and build its process groups."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type != "cpu":
        # Before the mesh: it would otherwise guess the device from the rank.
        torch.accelerator.set_device_index(device.index or 0)
    dist.init_process_group(
        backend,
        init_method=init_method or f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=plan.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    coords, rd = plan.coords(rank), plan.reduce_dp
    if rd in (1, plan.dp):  # replicas of one dp rank each (reduce: none) or one replica (allreduce)
        mesh = DeviceMesh(device.type, torch.arange(plan.world_size).reshape(plan.pp, plan.dp * plan.cp, plan.tp),
                          mesh_dim_names=MESH_DIMS)
        assert mesh.get_coordinate() == (coords.pp, coords.dp * plan.cp + coords.cp, coords.tp), \
            "the mesh must follow the plan's rank map"
    else:  # local_sgd, diloco replicas of several dp ranks: "dp" is a replica's (what ZeRO shards over)
        mesh = DeviceMesh(device.type, torch.arange(plan.world_size).reshape(plan.pp, plan.dp // rd, rd, plan.tp),
                          mesh_dim_names=REPLICA_MESH_DIMS)
        assert mesh.get_coordinate() == (coords.pp, coords.dp // rd, coords.dp % rd, coords.tp)

    def group(dim: str) -> dist.ProcessGroup | None:
        return mesh.get_group(dim) if mesh[dim].size() > 1 else None

    split = 1 < rd < plan.dp
    groups = RankGroups(rank=rank, dp=_subgroup(_all_dp(plan)) if split else group("dp"), pp=group("pp"),
                        pp_ranks=mesh["pp"].mesh.tolist(), tp=group("tp"), tp_mesh=mesh["tp"] if plan.tp > 1 else None,
                        dp_mesh=mesh["dp"] if rd * plan.cp > 1 else None, checkpoint=dist.new_group(backend="gloo"))
    reducing = reduction_groups(plan.layout)
    groups.reduce = group("dp") if rd * plan.cp > 1 else None  # the mesh's: DTensor and FSDP2 shard over its dimension
    assert groups.reduce is None or dist.get_process_group_ranks(groups.reduce) == \
        next(g for g in reducing["dense"] if rank in g), "the mesh's dp dimension must be the plan's dense group"
    groups.replicas = group("replica") if split else groups.dp
    if plan.cp > 1:
        groups.cp = _subgroup(plan.cp_groups())
        groups.cp_ranks = next(g for g in plan.cp_groups() if rank in g)
    if plan.config.model.moe is not None:
        groups.ep = _subgroup(plan.ep_groups())
        groups.experts = _subgroup(reducing["experts"])
        groups.stage = _subgroup(reducing["router"])
    if plan.config.model.tie_embeddings and plan.tied_groups():
        groups.tied = _subgroup(plan.tied_groups())
    return groups


def _all_dp(plan: Plan) -> list[list[int]]:
    """Every data-parallel group across all the replicas (one per (pp, tp))."""
    return [[plan.rank_of(p, t, d) for d in range(plan.dp)] for p in range(plan.pp) for t in range(plan.tp)]


def _subgroup(ranks: list[list[int]]) -> dist.ProcessGroup | None:
    """This rank's group among `ranks` (every rank creates all of them); None when it is alone in it (or in none:
    a middle pipeline stage holds no tied embedding)."""
    if len(ranks[0]) == 1:
        return None
    mine, _ = dist.new_subgroups_by_enumeration(ranks)
    return mine


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
