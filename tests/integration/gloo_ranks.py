"""The gloo tests' short names for `parallel.runtime.local_world`: a plan's ranks as local processes (torch.distributed
alone, no Ray), each a `RankDriver`; several plans in one spawned world with `run_plans`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import torch
from trainyard.parallel.io.checkpoint import step_dir
from trainyard.parallel.models import family_of
from trainyard.parallel.plan import Plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.local_world import PlanRun, RankResult, run_plan, run_plans, spawn
from trainyard.parallel.runtime.materialize import local_slices
from trainyard.parallel.runtime.tp.local_parts import local_part

K = TypeVar("K")

__all__ = ["PlanRun", "RankResult", "check_initial", "checkpointed_run", "initial_mismatches", "last_stage_losses",
           "layout_id", "losses", "run_named", "run_plans", "run_ranks", "spawn", "stats_of", "use_aot_eager"]


def run_ranks(plan: Plan, out_dir: Path | None = None, **checkpoints) -> list[list[dict]]:
    """Every rank's StepStats dicts, indexed [rank][step]. `checkpoints`: root and save (steps after which to
    save a checkpoint under root, in the background if background=True), or resume=(directory, step).
    (`out_dir` is not needed any more; kept for the callers that pass it.)"""
    run = PlanRun(plan, save_after=tuple(checkpoints.get("save", ())), root=checkpoints.get("root"),
                  background=checkpoints.get("background", False), resume=checkpoints.get("resume"))
    return stats_of(run_plan(run))


def checkpointed_run(out: Path, name: str, plan: Plan, checkpoints: dict, **options) -> PlanRun:
    """Run `name` of a test's table under `out`: `checkpoints` is {"save": step} (save after that step),
    {"resume": (run, step)} (go on from that run's checkpoint) or neither; a run from scratch checks its initial
    parameters (`check_initial`). `options`: more `PlanRun` fields."""
    resume = checkpoints.get("resume")
    return PlanRun(plan, save_after=(checkpoints["save"],) if "save" in checkpoints else (), root=str(out / name),
                   resume=(str(step_dir(out / resume[0], resume[1])), resume[1]) if resume else None,
                   at_start=None if resume else check_initial, **options)


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


def initial_mismatches(driver: RankDriver) -> list[str]:
    """What of a rank's chunks, as built on the meta device, sharded and materialized, is not bitwise the slice of
    the same stage built whole on the CPU (today's construction, `build_stage` from the seed): the names of the
    parameters and buffers that differ, and "tied" where the head stopped being the embedding's tensor. Call it
    before the first step (`PlanRun.at_start`), on a job without `init_from`."""
    plan, trainer = driver.plan, driver.trainer
    bad = []
    for chunk in trainer.chunks:
        whole = family_of(plan.config.model).build_stage(
            plan.config.model, [int(i) for i in chunk.blocks], first=chunk.first, last=chunk.last,
            seed=plan.config.seed, experts=plan.experts_of(driver.rank))
        expected = dict(whole.named_parameters()) | dict(whole.named_buffers())
        for name, p in [*chunk.named_parameters(), *chunk.named_buffers()]:
            if not torch.equal(local_part(p).cpu(), expected[name][local_slices(p)]):
                bad.append(name)
        if chunk.first and chunk.last and plan.config.model.tie_embeddings and chunk.lm_head.weight is not \
                chunk.wte.weight:
            bad.append("tied")
    return bad


def check_initial(driver: RankDriver) -> tuple[int, list[str]]:
    """`at_start` for a PlanRun: (how many tensors were compared, `initial_mismatches`)."""
    compared = sum(1 for chunk in driver.trainer.chunks for _ in [*chunk.named_parameters(), *chunk.named_buffers()])
    return compared, initial_mismatches(driver)


def use_aot_eager() -> None:
    """`setup` for a PlanRun with `compile: true`: the `aot_eager` backend (dynamo and AOTAutograd trace the blocks;
    no code is generated: inductor's C++ code generation costs half a minute per world on two cores)."""
    import torch._dynamo
    import trainyard.parallel.runtime.compile as compile_

    compile_.BACKEND = "aot_eager"
    # Each plan compiles as a fresh rank process would: else a block of other sizes than the last plan's is a
    # recompile with dynamic shapes, whose tracing here exceeds Python's recursion limit (llama after gpt2), and a
    # block compiled whole (1f1b) after one compiled with its linears eager (zb-h1) reuses the latter's graphs, its
    # linears left eager (measured: dynamo's guards on the block's code do not tell the two apart)
    torch._dynamo.reset()
