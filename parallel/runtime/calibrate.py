"""Calibration's measuring part: the machine costs the planner's cost model needs, measured by a short run.

`measure(world)` spawns a small gloo world (`parallel.runtime.local_world.spawn`, one thread per rank as a rank gets)
and times matmuls of a few sizes, all-reduce, point-to-point, all-to-all, all-gather and reduce-scatter at a few message
sizes and an AdamW step at a few parameter counts, and compute's slowdown with 1 to 4 ranks busy at once;
`measure_fixed` times the real trainer on the tiny runs `parallel.plan.planner.calibration.FIXED_RUNS` names. The fits
from those timings, the node type and the cache are `parallel.plan.planner.calibration`'s (pure, no torch).
`machine_costs(state_dir, cluster)` returns the cached costs of the cluster's node type and measures them on first use.
The service measures locally, in its own machine: right for the embedded (laptop) cluster, whose node is this machine; a
GPU node type nobody measured yet is planned with `machine_costs.default_gpu_costs` (a worker-side calibration on GPU
nodes is not written yet).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainyard.parallel.plan.admission import ClusterResources
from trainyard.parallel.plan.planner.calibration import (
    FIXED_REPEATS,
    FIXED_RUNS,
    FIXED_STEPS,
    ONE_RANK,
    TOKENS,
    TOKENS_WIDTH,
    WIDE_SEQ,
    WIDTHS,
    cached_costs,
    comm_contention_from,
    contention_from,
    fixed_from_steps,
    flops_from_steps,
    node_type,
    paired_slowdowns,
    quartile,
    store_costs,
    tiny_config,
    two_point_fit,
    wide_config,
)
from trainyard.parallel.plan.planner.machine_costs import MachineCosts

MATMUL_SIZES = (8, 64, 256, 512)
MESSAGE_BYTES = (4096, 65536, 1 << 20, 4 << 20)
OPTIMIZER_ELEMENTS = (1 << 14, 1 << 17, 1 << 20)
REPEATS = 7
CONTENTION_RANKS = 4
"""Up to how many ranks busy at once the contention is measured (a CPU node runs this many or fewer here)."""
CONTENTION_WORK, CONTENTION_ROUNDS = (384, 256), 20
"""The contention's work (an MLP block's step: width, tokens) and its rounds, taken twice: before the collectives and
after them (on this VM one 5-second window measured 2 ranks at 1.69 where 8 others measured 1.03-1.31)."""
COMM_CONTENTION_BYTES = (65536, 1 << 20, 4 << 20)
"""The all-reduce sizes timed with every rank count past `world` (`MachineCosts.comm_contention`)."""


def machine_costs(state_dir: Path, cluster: ClusterResources, world: int = 2) -> MachineCosts:
    """The cached costs of the cluster's node type, measured (and cached) on first use."""
    known = cached_costs(state_dir, cluster)
    if known is not None:
        return known
    key = node_type(cluster)
    costs = measure(world, key)
    store_costs(state_dir, key, costs)
    return costs


def measure(world: int = 2, key: str = "", node_ranks: int = CONTENTION_RANKS) -> MachineCosts:
    """Spawn the ranks and time the pieces (rank 0's lower quartiles, fitted), then the trainer's fixed costs on tiny
    models (`measure_fixed`). `world`: the ranks the collectives are measured with; `node_ranks`: up to how
    many ranks busy at once the contention is measured (the most a node of this type runs)."""
    from trainyard.parallel.runtime.local_world import spawn

    ranks = max(world, node_ranks)
    with tempfile.TemporaryDirectory(prefix="calibrate-") as out:
        spawn(_rank, ranks, world, ranks, out)
        raw = json.loads((Path(out) / "rank0.json").read_text())
    contention = contention_from(raw.pop("contention"), len(os.sched_getaffinity(0)))
    at_k = {int(name.rsplit(" ", 1)[1]): raw.pop(name) for name in list(raw) if name.startswith("allreduce at ")}
    # Two points per fit: the latency is the smallest sizes' time (a fixed cost per call), the throughput the
    # slope to the largest. A least-squares line over all sizes lets the large sizes' noise swing the intercept
    # (often below zero), and the planner's ranking at small sizes hangs on that intercept.
    fits: dict[str, Any] = {name: two_point_fit(points) for name, points in raw.items()}
    costs = MachineCosts(node_type=key, world=world, measured=raw, contention=contention, **fits)
    costs = replace(costs, comm_contention=comm_contention_from(costs, at_k),
                    measured={**raw, **{f"allreduce at {k}": v for k, v in at_k.items()}})
    return measure_fixed(costs)


def measure_fixed(costs: MachineCosts) -> MachineCosts:
    """The trainer's fixed costs, from the real trainer (`parallel.runtime.local_world.run_plans`) on tiny models (whose
    FLOPs take microseconds): per block, per micro-batch and per step from one-rank runs of 2 to 8 blocks and 1
    to 4 micro-batches; tensor and sequence parallelism's extra per block from tp = 2, and a pipeline's extra
    per micro-batch (its hand-overs and waits) from pp = 2 at 2 and 8 micro-batches, data parallelism's
    extra per step (beyond its all-reduce) from dp = 2, and ZeRO-2's and -3's extra per block (per step and per
    micro-batch, beyond their collectives) from dp = 2 at 2 and 8 blocks and 1 and 4 micro-batches, each divided
    by the measured contention of 2 ranks.
    The runs are repeated round-robin (a burst of load falls on all of them); a run's time is the lower
    quartile over its steps after each run's first (the slowest rank's)."""
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.runtime.local_world import PlanRun, run_plans

    configs = {name: tiny_config(blocks, par) for name, (blocks, par) in FIXED_RUNS.items()}
    configs |= {f"width {d}": wide_config(d) for d in WIDTHS}
    configs |= {f"width {TOKENS_WIDTH} tokens {t}": wide_config(TOKENS_WIDTH, t // WIDE_SEQ) for t in TOKENS}
    plans = [make_plan(c) for c in configs.values()]
    results = run_plans([PlanRun(plan=p) for _ in range(FIXED_REPEATS) for p in plans])
    step: dict[str, float] = {}
    share: list[float] = []
    for i, name in enumerate(configs):
        runs = results[i::len(plans)]
        step[name] = quartile(max(r.stats[s]["compute_s"] for r in ranks) for ranks in runs
                              for s in range(1, FIXED_STEPS))
        if name in ONE_RANK:
            share += [r[0].stats[s]["backward_s"] / max(r[0].stats[s]["forward_s"] + r[0].stats[s]["backward_s"],
                                                         1e-12) for r in runs for s in range(1, FIXED_STEPS)]
    return flops_from_steps(fixed_from_steps(costs, step, statistics.median(share)), step)


def _timed(fn, repeats: int = REPEATS) -> float:
    """The lower quartile of `repeats` runs after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return quartile(times)


def reference_work(width: int = CONTENTION_WORK[0], tokens: int = CONTENTION_WORK[1]) -> Callable[[], None]:
    """One training step of an MLP block (`width` wide, `tokens` rows) with AdamW, as a function to call: the work
    compute's contention is timed on."""
    import torch

    block = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
    adamw = torch.optim.AdamW(block.parameters(), foreach=True)
    x = torch.randn(tokens, width)

    def work() -> None:
        block(x).square().mean().backward()
        adamw.step()
        adamw.zero_grad()

    return work


def _contention_rounds(rank: int, ranks: int, work: Callable[[], None]) -> list[list[float]]:
    """CONTENTION_ROUNDS rounds of `work` on k = 1 .. `ranks` ranks at once; per round, the slowest busy rank's time
    for each k (round-robin over k, so the machine's drift between rounds falls on every k of a round alike)."""
    import torch
    import torch.distributed as dist

    work()
    slowest, out = torch.zeros(1), []
    for _ in range(CONTENTION_ROUNDS):
        row = []
        for k in range(1, ranks + 1):
            dist.barrier()
            slowest.zero_()
            if rank < k:
                start = time.perf_counter()
                work()
                slowest += time.perf_counter() - start
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a synchronous step waits for its slowest rank
            row.append(float(slowest))
        out.append(row)
    return out


def _rank(rank: int, port: int, world: int, ranks: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    group = dist.new_group(list(range(world)))  # the collectives' ranks; the others wait at the barriers
    points: dict[str, list] = {"matmul": [], "allreduce": [], "p2p": [], "alltoall": [], "optimizer": [],
                               "allgather": [], "reducescatter": [], "contention": []}
    if rank == 0:  # one rank alone: compute's own speed
        for n in MATMUL_SIZES:
            a, b = torch.randn(n * 4, n), torch.randn(n, n)
            points["matmul"].append((2 * n * 4 * n * n, _timed(lambda a=a, b=b: a @ b)))
        for n in OPTIMIZER_ELEMENTS:
            p = torch.nn.Parameter(torch.randn(n))
            p.grad = torch.randn(n)
            opt = torch.optim.AdamW([p], foreach=True)
            points["optimizer"].append((n, _timed(opt.step)))
    # k ranks training at once (k = 1 .. all): how much the slowest of them is slowed by sharing the node's
    # cores and memory (with other processes too: the more ranks, the likelier one of them waits for a core).
    # The work is an MLP block's step with AdamW, not matmuls alone: with 4 ranks on this machine's 2 cores,
    # cache-resident matmuls measured 2.8x, memory-bound updates 4.1x and such a step 3.4x, and the planner
    # measured 4 ranks of data parallelism 1.3-1.5x slower than its matmul-based prediction. Two windows, before
    # the collectives and after them: a machine that drifts is caught in more than one state.
    work = reference_work()
    rounds = _contention_rounds(rank, ranks, work)
    dist.barrier()
    for size in MESSAGE_BYTES if rank < world else ():
        t = torch.zeros(size // 4)
        dist.barrier(group=group)
        points["allreduce"].append((size, _timed(lambda t=t: dist.all_reduce(t, group=group))))
        dist.barrier(group=group)
        peer = rank ^ 1

        def ping(t=t, peer=peer):
            if peer >= world:
                return
            if rank % 2 == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)

        points["p2p"].append((size, _timed(ping) / 2))
        dist.barrier(group=group)
        src, dst = torch.zeros(size // 4 // world * world), torch.zeros(size // 4 // world * world)
        points["alltoall"].append((size, _timed(lambda s=src, d=dst: dist.all_to_all_single(d, s, group=group))))
        dist.barrier(group=group)
        shard = torch.zeros(size // 4 // world)
        points["allgather"].append((size, _timed(lambda s=shard, d=dst: dist.all_gather_into_tensor(d, s,
                                                                                                     group=group))))
        dist.barrier(group=group)
        points["reducescatter"].append((size, _timed(lambda s=src, d=shard: dist.reduce_scatter_tensor(d, s,
                                                                                                        group=group))))
    rounds += _contention_rounds(rank, ranks, work)  # the second window
    if rank == 0:
        points["contention"] = paired_slowdowns(rounds)
    # an all-reduce of k = world + 1 .. all ranks of the node at once (gloo's copies and wake-ups on shared cores)
    for k in range(world + 1, ranks + 1):
        members = dist.new_group(list(range(k)))  # every rank creates every group, in the same order
        for size in COMM_CONTENTION_BYTES:
            t = torch.zeros(size // 4)
            dist.barrier()
            if rank < k:
                took = _timed(lambda t=t, g=members: dist.all_reduce(t, group=g))
                points.setdefault(f"allreduce at {k}", []).append((size, took))
    if rank == 0:
        (Path(out) / "rank0.json").write_text(json.dumps(points))
    dist.barrier()
    dist.destroy_process_group()
