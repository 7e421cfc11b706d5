"""Ranks as local processes on gloo, without Ray: the gloo tests' and the benches' launcher (torchrun's job on
one machine, for a function rather than a script).

`spawn(fn, nprocs, *args)` runs `fn(rank, port, *args)` in `nprocs` processes forked from a forkserver that has
imported torch and the trainer once, so a rank starts in a fraction of a second instead of paying torch's import
(seconds on a loaded machine). `run_plans(runs)` spawns one world and runs several plans in it one after the
other, each on a fresh rendezvous with its own subgroups (a `RankDriver` per plan, closed before the next) at a
file store, so no port is picked before it is bound; the ranks a plan does not use sit it out. What each rank
returns comes back through files, as torch.save'd objects.
"""

from __future__ import annotations

import multiprocessing
import socket
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from trainyard.parallel.plan import Plan
from trainyard.parallel.runtime.driver import RankDriver, Save

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint",
           "trainyard.parallel.runtime.driver", "trainyard.parallel.runtime.local_world"]
"""What the forkserver imports once for every rank it forks: besides torch and the trainer, `torch._dynamo`, which
DTensor (tensor parallelism), FSDP2 (ZeRO-2/3) and `compile: true` import (1.2 s of a rank's CPU on this machine; the
optimizers do without it: `parallel.optim.dynamo_free`), and DCP, which a checkpoint's save or load imports (0.7 s)."""
START_METHOD = "forkserver"
RANK_TIMEOUT_S = 600.0  # also how long a rank waits at a later plan's rendezvous while earlier plans run


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free right now (held together while picked, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def spawn(fn: Callable[..., None], nprocs: int, *args: object) -> None:
    """Run fn(rank, port, *args) in `nprocs` processes and wait for all; `port` is a free one for the
    rendezvous. A rank's exception is raised here (torch's ProcessRaisedException, with its traceback)."""
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=(free_ports(1)[0], *args), nprocs=nprocs, start_method=START_METHOD)


@dataclass(frozen=True)
class PlanRun:
    """One plan's part of a world: call `setup()` on every rank before its driver is built, train `steps`
    (default: from `resume`'s step, or 0, to the plan's last), save after the step counts in `save_after` under
    `root` and take the validation loss after those in `evaluate_after`, then call `probe(driver, stats)` on
    every rank and return what it returns along with the steps' stats (`setup`, `at_start` and `probe`:
    module-level functions, so they pickle)."""

    plan: Plan
    steps: range | None = None
    save_after: tuple[int, ...] = ()
    evaluate_after: tuple[int, ...] = ()
    root: str | None = None
    background: bool = False
    resume: tuple[str, int] | None = None
    """(checkpoint directory, step) to load before the first step."""
    probe: Callable[[RankDriver, list[dict]], Any] | None = None
    at_start: Callable[[RankDriver], Any] | None = None
    """Called on every rank once its driver is built (and a `resume` loaded), before the first step: what it
    returns comes back as `RankResult.start` (e.g. a look at the initial parameters)."""
    setup: Callable[[], None] | None = None
    """What a rank does before the driver exists: e.g. wrap a reader the trainer's construction uses."""
    extra: dict = field(default_factory=dict)
    """Anything a probe wants to know (it gets the driver and stats only): `run.extra` stays with the run."""


@dataclass(frozen=True)
class RankResult:
    stats: list[dict]
    """The StepStats dicts of each step this rank ran."""
    probe: Any = None
    start: Any = None
    """What `PlanRun.at_start` returned."""


def run_plans(runs: Sequence[PlanRun]) -> list[list[RankResult]]:
    """Each run's results, [run][rank], from one spawned world as large as the largest plan."""
    world = max(run.plan.world_size for run in runs)
    with tempfile.TemporaryDirectory(prefix="local-world-") as out:
        try:
            spawn(_world_rank, world, list(runs), out)
        except Exception as e:  # torch names one failed rank, often one that failed because another did first
            raised = sorted(Path(out).glob("failed-rank*.txt"), key=lambda p: p.stat().st_mtime_ns)  # first first
            if not raised:
                raise
            details = "\n".join(f"--- {p.stem} ---\n{p.read_text()}" for p in raised)
            raise RuntimeError(f"a rank of the local world failed, {raised[0].stem} first:\n{details}") from e
        return [[torch.load(Path(out) / f"run{i}-rank{r}.pt", weights_only=False) for r in range(run.plan.world_size)]
                for i, run in enumerate(runs)]


def run_plan(run: PlanRun) -> list[RankResult]:
    """One run in its own world, [rank]."""
    return run_plans([run])[0]


def _world_rank(rank: int, port: int, runs: list[PlanRun], out: str) -> None:
    """One rank of the world: each run it takes part in, meeting that run's other ranks at a file store of its own
    in `out` (no port: one picked before it is bound can be taken meanwhile, by any process's connection)."""
    torch.set_num_threads(1)
    for i, run in enumerate(runs):
        if rank >= run.plan.world_size:
            continue
        try:
            result = _run_one(run, rank, f"file://{Path(out) / f'rendezvous-{i}'}")
        except BaseException:  # for run_plans to name every rank that failed, and which failed first
            (Path(out) / f"failed-rank{rank}.txt").write_text(f"in run {i} of {len(runs)}:\n{traceback.format_exc()}")
            raise
        torch.save(result, Path(out) / f"run{i}-rank{rank}.pt")


def _run_one(run: PlanRun, rank: int, init_method: str) -> RankResult:
    if run.setup is not None:
        run.setup()
    driver = RankDriver(run.plan, rank, "", 0, torch.device("cpu"), timeout_s=RANK_TIMEOUT_S, init_method=init_method)
    try:
        start = 0
        if run.resume is not None:
            directory, start = run.resume
            driver.load(Path(directory), start)
        at_start = run.at_start(driver) if run.at_start is not None else None
        steps = run.steps if run.steps is not None else range(start, run.plan.config.steps)
        save = Save(Path(run.root), {}, run.background) if run.root is not None else None
        stats = driver.run(steps, save_after=run.save_after, save=save, evaluate_after=run.evaluate_after)
        return RankResult(stats, run.probe(driver, stats) if run.probe is not None else None, at_start)
    finally:
        driver.close()
