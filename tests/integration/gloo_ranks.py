"""Run a plan's ranks as spawned processes on gloo, with torch.distributed alone (no Ray)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from parallel.data import open_dataset, step_microbatches
from parallel.distributed import init_distributed, shutdown_distributed
from parallel.plan import Plan
from parallel.trainer import RankTrainer


def _rank_main(rank: int, port: int, plan: Plan, out_dir: str, checkpoints: dict) -> None:
    torch.set_num_threads(1)
    groups = init_distributed(plan, rank, "127.0.0.1", port, torch.device("cpu"), timeout_s=120)
    trainer = RankTrainer(plan, rank, groups, torch.device("cpu"))
    cfg = plan.config
    start = 0
    if checkpoints.get("resume"):
        directory, start = checkpoints["resume"]
        trainer.load_checkpoint(Path(directory), start)
    num_samples = open_dataset(cfg).num_samples
    stats = []
    for step in range(start, cfg.steps):
        stats.append(trainer.train_step(step, step_microbatches(plan, rank, step, num_samples)).to_dict())
        if step + 1 in checkpoints.get("save", ()):
            background = checkpoints.get("background", False)
            trainer.save_checkpoint(Path(checkpoints["root"]), step + 1, {}, background=background)
    trainer.finish_checkpoint()
    torch.save(stats, Path(out_dir) / f"rank{rank}.pt")
    shutdown_distributed()


def spawn(fn: Callable[..., None], nprocs: int, *args: object) -> None:
    """Run fn(rank, port, *args) in `nprocs` spawned processes; `port` is a free one for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(fn, args=(port, *args), nprocs=nprocs, start_method="spawn")


def run_ranks(plan: Plan, out_dir: Path, **checkpoints) -> list[list[dict]]:
    """Every rank's StepStats dicts, indexed [rank][step]. `checkpoints`: root and save (steps after which to
    save a checkpoint under root, in the background if background=True), or resume=(directory, step)."""
    spawn(_rank_main, plan.world_size, plan, str(out_dir), checkpoints)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(plan.world_size)]


def losses(plan: Plan, out_dir: Path) -> list[float]:
    per_rank = run_ranks(plan, out_dir)
    last = next(r for r in range(plan.world_size) if per_rank[r][0]["loss"] is not None)
    return [s["loss"] for s in per_rank[last]]
