"""Calibration: the machine costs the planner's cost model needs, measured by a short run, cached per node type.

`measure(world)` spawns a small gloo world (`parallel.local_world.spawn`, one thread per rank as a rank
gets) and times matmuls of a few sizes, all-reduce, point-to-point and all-to-all at a few message sizes
and an AdamW step at a few parameter counts, each fitted as latency + size / throughput
(`parallel.cost_model.Fit`). `machine_costs(state_dir, cluster)` returns the cached costs of the cluster's
node type (a JSON file, `calibration.json` in the service's state directory, keyed by node type: CPU model
and count, GPUs) and measures them on first use. The service measures locally, in its own machine: right
for the embedded (laptop) cluster, whose node is this machine; a GPU node type nobody measured yet is
planned with `cost_model.default_gpu_costs` (a worker-side calibration on GPU nodes is not written yet).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

from trainyard.parallel.admission import ClusterResources
from trainyard.parallel.cost_model import Fit, MachineCosts, default_gpu_costs

CACHE_FILE = "calibration.json"
MATMUL_SIZES = (8, 64, 256, 512)
MESSAGE_BYTES = (4096, 65536, 1 << 20, 4 << 20)
OPTIMIZER_ELEMENTS = (1 << 14, 1 << 17, 1 << 20)
REPEATS = 5


def node_type(cluster: ClusterResources) -> str:
    """The node type a calibration is cached under: this machine's CPU model, the nodes' CPUs and GPUs."""
    node = max(cluster.nodes, key=lambda n: (n.gpus, n.cpus)) if cluster.nodes else None
    cpus = f"{node.cpus:g}" if node else "?"
    gpus = f", {node.gpus:g} GPU of {node.gpu_memory / 2**30:.0f} GiB" if node and node.gpus else ""
    return f"{_cpu_model()} x{cpus} CPU{gpus}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_costs(state_dir: Path, cluster: ClusterResources, world: int = 2) -> MachineCosts:
    """The cached costs of the cluster's node type, measured (and cached) on first use."""
    key = node_type(cluster)
    path = Path(state_dir) / CACHE_FILE
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key in cache:
        return MachineCosts.from_dict(cache[key])
    if cluster.gpus > 0:
        return default_gpu_costs(key)
    costs = measure(world, key)
    cache[key] = costs.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=2))
    os.replace(tmp, path)
    return costs


def measure(world: int = 2, key: str = "") -> MachineCosts:
    """Spawn `world` ranks and time the pieces; rank 0's medians, fitted."""
    from trainyard.parallel.local_world import spawn

    with tempfile.TemporaryDirectory(prefix="calibrate-") as out:
        spawn(_rank, world, world, out)
        raw = json.loads((Path(out) / "rank0.json").read_text())
    # Two points per fit: the latency is the smallest size's time (a fixed cost per call), the throughput the
    # slope to the largest. A least-squares line over all sizes lets the large sizes' noise swing the intercept
    # (often below zero), and the planner's ranking at small sizes hangs on that intercept.
    fits = {name: _two_point(points) for name, points in raw.items()}
    return MachineCosts(node_type=key, world=world, measured=raw, **fits)


def _two_point(points: list[list[float]]) -> Fit:
    (small_size, small), (large_size, large) = points[0], points[-1]
    return Fit(latency_s=small, per_s=(large_size - small_size) / max(large - small, 1e-12))


def _timed(fn, repeats: int = REPEATS) -> float:
    """The fastest of `repeats` runs after a warm-up: on a shared machine, interference only adds time."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _rank(rank: int, port: int, world: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    points: dict[str, list[tuple[float, float]]] = {"matmul": [], "allreduce": [], "p2p": [], "alltoall": [],
                                                    "optimizer": []}
    for n in MATMUL_SIZES:
        a, b = torch.randn(n * 4, n), torch.randn(n, n)
        points["matmul"].append((2 * n * 4 * n * n, _timed(lambda a=a, b=b: a @ b)))
    for size in MESSAGE_BYTES:
        t = torch.zeros(size // 4)
        dist.barrier()
        points["allreduce"].append((size, _timed(lambda t=t: dist.all_reduce(t))))
        dist.barrier()
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
        dist.barrier()
        src, dst = torch.zeros(size // 4 // world * world), torch.zeros(size // 4 // world * world)
        points["alltoall"].append((size, _timed(lambda s=src, d=dst: dist.all_to_all_single(d, s))))
    for n in OPTIMIZER_ELEMENTS:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], foreach=True)
        points["optimizer"].append((n, _timed(opt.step)))
    if rank == 0:
        (Path(out) / "rank0.json").write_text(json.dumps(points))
    dist.barrier()
    dist.destroy_process_group()

