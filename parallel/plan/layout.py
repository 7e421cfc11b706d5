"""The layout: where every rank sits and what it holds, built from degrees alone (torchtitan's ParallelDims).

A `Layout` knows the degrees (dp, pp, tp, ep, cp, vpp), the micro-batching, the rank grid and its coordinates,
the process groups along each axis, the blocks of each virtual stage, the schedule's action lists (`actions`), and the
placement-group gang the ranks need. It knows no JobConfig: `parallel.plan.make_plan` builds one from a
checked config, and a planner can build one from any degrees it wants to try, then ask the memory plan
(`parallel.plan.memory.estimate.estimate(layout, config)`) what it costs. Pure: no I/O, no torch.

Rank order is tp fastest, then cp, then dp, then pp (Megatron's order): a tensor-parallel group is a run of
consecutive ranks, so it fits in one placement-group bundle and therefore on one node; a context-parallel group is
the tp groups of one replica's dp coordinate. The ranks that sum gradients (and that ZeRO shards over) are a replica's
dp x cp ranks: each cp rank's gradient is its share of the sequences' loss.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainyard.parallel.plan.schedule.actions import Action, stage_location, virtual_stage
from trainyard.parallel.plan.schedule.schedules import build_schedule, placement_of


@dataclass(frozen=True)
class RankCoords:
    rank: int
    pp: int
    tp: int
    dp: int
    cp: int = 0
    """The rank's place in its context-parallel group (which chunks of every sequence it holds)."""


@dataclass(frozen=True)
class Gang:
    """What a job needs from the cluster, all at once: `count` identical bundles (one per tp group)."""

    bundle: dict[str, float]
    count: int

    @staticmethod
    def of(cpus_per_worker: float, gpus_per_worker: int, *, tp: int, groups: int) -> Gang:
        bundle = {"CPU": cpus_per_worker * tp}
        if gpus_per_worker:
            bundle["GPU"] = float(gpus_per_worker * tp)
        return Gang(bundle=bundle, count=groups)

    def bundles(self) -> list[dict[str, float]]:
        return [dict(self.bundle) for _ in range(self.count)]

    def needed(self) -> dict[str, float]:
        return {"CPU": self.bundle["CPU"] * self.count, "GPU": self.bundle.get("GPU", 0.0) * self.count}

    def placeable(self, nodes: list[dict[str, float]]) -> int:
        """How many of the bundles fit on nodes with these free (or total) resources; Ray's PACK strategy
        packs whole bundles onto nodes, so this is the sum over nodes of the copies each can hold."""
        return sum(min(math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in self.bundle.items() if v > 0)
                   for node in nodes)


@dataclass(frozen=True, kw_only=True)
class Layout:
    dp: int
    pp: int
    tp: int
    ep: int = 1
    cp: int = 1
    """Context-parallel ranks per replica (each sequence split over them)."""
    vpp: int = 1
    microbatches: int = 1
    micro_batch_size: int = 1
    """Sequences per micro-batch on one data-parallel rank."""
    stage_layers: tuple[tuple[int, ...], ...] = ()
    """Global block indices of each virtual stage v (`placement` says which rank and chunk hold it)."""
    placement: str = "interleaved"
    """How virtual stages sit on the ranks (`parallel.plan.schedule.actions.virtual_stage`): the schedule kind's."""
    actions: tuple[tuple[Action, ...], ...] = ()
    """The action list each pipeline rank runs every step (index = pp rank), built by the schedule kind's compute order
    (`parallel.plan.schedule.schedules`; the kind itself is the plan's `schedule`)."""
    experts: int = 0
    """Experts of each mixture-of-experts block (0: a dense model); ep ranks host experts / ep each."""
    gpus_per_worker: int = 0
    cpus_per_worker: float = 1.0
    replica_dp: int = 0
    """Data-parallel ranks that sum their gradients every step (local_sgd, diloco: one replica's,
    `replica_sync.replica_dp`); 0: all dp ranks."""

    @property
    def reduce_dp(self) -> int:
        """The data-parallel ranks of one replica (`replica_dp`, or every dp rank)."""
        return self.replica_dp or self.dp

    @functools.cached_property
    def ranks(self) -> tuple[RankCoords, ...]:
        """Every rank's coordinates, index = rank (built on first use: a fit check needs only the degrees)."""
        return rank_grid(self.pp, self.tp, self.dp, self.cp)

    @staticmethod
    def build(*, dp: int, pp: int, tp: int, ep: int = 1, cp: int = 1, vpp: int = 1, microbatches: int = 1,
              micro_batch_size: int = 1, layer_counts: Sequence[int], schedule: str = "1f1b", experts: int = 0,
              gpus_per_worker: int = 0, cpus_per_worker: float = 1.0, replica_dp: int = 0) -> Layout:
        """A layout from degrees, the blocks of each virtual stage and a schedule kind (which must suit
        pp, microbatches and vpp: `parallel.plan.schedule.schedules.check_schedule_args`)."""
        return Layout(dp=dp, pp=pp, tp=tp, ep=ep, cp=cp, vpp=vpp, microbatches=microbatches,
                      micro_batch_size=micro_batch_size, stage_layers=stage_layers_of(layer_counts),
                      actions=tuple(map(tuple, build_schedule(schedule, pp, microbatches, vpp))),
                      placement=placement_of(schedule),
                      experts=experts, gpus_per_worker=gpus_per_worker, cpus_per_worker=cpus_per_worker,
                      replica_dp=replica_dp)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def n_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, pp: int, tp: int, dp: int, cp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> RankCoords:
        return self.ranks[rank]

    def dp_groups(self) -> list[list[int]]:
        """Ranks that hold the same parameters and sum gradients every step: one replica's (`reduce_dp`
        consecutive dp ranks; all of them but with local_sgd and diloco)."""
        rd = self.reduce_dp
        return [[self.rank_of(p, t, b * rd + i, c) for i in range(rd) for c in range(self.cp)]
                for p in range(self.pp) for t in range(self.tp) for b in range(self.dp // rd)]

    def cp_groups(self) -> list[list[int]]:
        """Ranks that split the same sequences (same pp, tp and dp), in chunk order (index = cp coordinate)."""
        return [[self.rank_of(p, t, d, c) for c in range(self.cp)]
                for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def cross_replica_groups(self) -> list[list[int]]:
        """local_sgd, diloco: the ranks holding the same shard (same pp, tp and place in their replica) in every
        replica, which average it at the syncs."""
        rd = self.reduce_dp
        return [[self.rank_of(p, t, b * rd + i) for b in range(self.dp // rd)]
                for p in range(self.pp) for t in range(self.tp) for i in range(rd)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks that form one pipeline, in stage order."""
        return [[self.rank_of(p, t, d, c) for p in range(self.pp)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, t, d, c) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp) for c in range(self.cp)]

    def ep_rank(self, rank: int) -> int:
        """A rank's place in its expert-parallel group: ep groups are runs of `ep` consecutive dp ranks."""
        return self.coords(rank).dp % self.ep

    def ep_groups(self) -> list[list[int]]:
        """Ranks that exchange tokens: same pp and tp, dp ranks g*ep .. g*ep + ep - 1."""
        return [[self.rank_of(p, t, g * self.ep + j) for j in range(self.ep)]
                for p in range(self.pp) for t in range(self.tp) for g in range(self.dp // self.ep)]

    def expert_groups(self) -> list[list[int]]:
        """Ranks that hold the same experts and sum their gradients: one stage, one ep index, every tp rank
        (each computed its own slice of the tokens) and every dp rank of one replica (every dp rank but with
        local_sgd and diloco)."""
        rd = self.reduce_dp
        return [[self.rank_of(p, t, d) for d in range(b * rd + j, (b + 1) * rd, self.ep) for t in range(self.tp)]
                for p in range(self.pp) for b in range(self.dp // rd) for j in range(self.ep)]

    def stage_groups(self) -> list[list[int]]:
        """Every rank of one pipeline stage in one replica: they sum the router's gradients and the MoE
        statistics."""
        rd = self.reduce_dp
        return [[self.rank_of(p, t, d) for d in range(b * rd, (b + 1) * rd) for t in range(self.tp)]
                for p in range(self.pp) for b in range(self.dp // rd)]

    def tied_groups(self) -> list[list[int]]:
        """Ranks holding the first and the last virtual stage of one pipeline, one pair per (dp, tp): they sum the
        two copies' gradients of a tied embedding. None when one rank holds both (the V placement's rank 0)."""
        last = stage_location(self.n_virtual_stages - 1, self.pp, self.placement)[0]
        if last == 0:
            return []
        return [[self.rank_of(0, t, d, c), self.rank_of(last, t, d, c)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def experts_of(self, rank: int) -> range:
        """Global indices of the experts a rank hosts in each of its MoE blocks (empty for a dense model)."""
        if not self.experts:
            return range(0)
        per_rank = self.experts // self.ep
        start = self.ep_rank(rank) * per_rank
        return range(start, start + per_rank)

    def chunk_layers(self, pp_rank: int) -> list[tuple[int, ...]]:
        """The blocks of each chunk a pipeline rank holds, chunk 0 first."""
        return [self.stage_layers[virtual_stage(pp_rank, c, self.pp, self.placement)] for c in range(self.vpp)]

    def bundle_of(self, rank: int) -> int:
        """The placement-group bundle a rank is placed in: its tensor-parallel group's, so the ranks of one
        tp group always share a node."""
        return rank // self.tp

    def worker_name(self, rank: int) -> str:
        """`pp0-tp1-dp2`, and with expert parallelism the experts it hosts: `pp0-tp1-dp2-experts4-7`."""
        c = self.coords(rank)
        name = f"pp{c.pp}-tp{c.tp}-dp{c.dp}" + (f"-cp{c.cp}" if self.cp > 1 else "")
        if self.ep > 1:
            experts = self.experts_of(rank)
            name += f"-experts{experts[0]}-{experts[-1]}"
        return name

    @property
    def gang(self) -> Gang:
        return Gang.of(self.cpus_per_worker, self.gpus_per_worker, tp=self.tp, groups=self.dp * self.cp * self.pp)

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per tensor-parallel group (a bundle always lands on one node)."""
        return self.gang.bundles()

    def resources_needed(self) -> dict[str, float]:
        return self.gang.needed()


def rank_grid(pp: int, tp: int, dp: int, cp: int = 1) -> tuple[RankCoords, ...]:
    grid = [RankCoords(rank=((p * dp + d) * cp + c) * tp + t, pp=p, tp=t, dp=d, cp=c)
            for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]
    return tuple(sorted(grid, key=lambda c: c.rank))


def even_layer_counts(n_layer: int, n_stages: int) -> list[int]:
    """Blocks per virtual stage, as even as possible (needs n_layer >= n_stages)."""
    base, extra = divmod(n_layer, n_stages)
    # Middle stages take the extra blocks first: the first stage also embeds and the last runs the head
    # and loss (the heavier of the two, so it is the last to get one).
    preferred = [*range(1, n_stages - 1), 0, n_stages - 1][:extra]
    return [base + (v in preferred) for v in range(n_stages)]


def stage_layers_of(counts: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Global block indices of each virtual stage, from the number of blocks each holds."""
    starts = [sum(counts[:v]) for v in range(len(counts))]
    return tuple(tuple(range(s, s + c)) for s, c in zip(starts, counts, strict=True))
