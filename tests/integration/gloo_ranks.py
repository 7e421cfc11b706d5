"""The gloo tests' short names for `parallel.runtime.local_world`: a plan's ranks as local processes (torch.distributed
alone, no Ray), each a `RankDriver`; several plans in one spawned world with `run_plans`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from trainyard.parallel.plan import Plan
from trainyard.parallel.runtime.local_world import PlanRun, RankResult, run_plan, run_plans, spawn

K = TypeVar("K")

__all__ = ["PlanRun", "RankResult", "last_stage_losses", "layout_id", "losses", "run_named", "run_plans", "run_ranks",
           "spawn", "stats_of"]


def run_ranks(plan: Plan, out_dir: Path | None = None, **checkpoints) -> list[list[dict]]:
    """Every rank's StepStats dicts, indexed [rank][step]. `checkpoints`: root and save (steps after which to
    save a checkpoint under root, in the background if background=True), or resume=(directory, step).
    (`out_dir` is not needed any more; kept for the callers that pass it.)"""
    run = PlanRun(plan, save_after=tuple(checkpoints.get("save", ())), root=checkpoints.get("root"),
                  background=checkpoints.get("background", False), resume=checkpoints.get("resume"))
    return stats_of(run_plan(run))


def run_named(plans: Mapping[K, Plan]) -> dict[K, list[list[dict]]]:
    """Each plan's [rank][step] StepStats dicts, by the plan's key: all the plans, one after the other, in one
    spawned world (as large as the largest plan)."""
    results = run_plans([PlanRun(plan) for plan in plans.values()])
    return {key: stats_of(r) for key, r in zip(plans, results, strict=True)}


def layout_id(parallel: dict) -> str:
    """A test id for a `parallel` section: {"pp": 2, "microbatches": 4} -> "pp2-microbatches4"."""
    return "-".join(f"{k}{v}" for k, v in parallel.items())


def stats_of(results: list[RankResult]) -> list[list[dict]]:
    """[rank][step] StepStats dicts of one run's results."""
    return [r.stats for r in results]


def last_stage_losses(per_rank: list[list[dict]]) -> list[float]:
    """The losses of the first rank that has them (a last-stage rank)."""
    return [s["loss"] for s in next(stats for stats in per_rank if stats[0]["loss"] is not None)]


def losses(plan: Plan, out_dir: Path | None = None) -> list[float]:
    return last_stage_losses(run_ranks(plan, out_dir))
