"""Section `stragglers`: replicas that do not wait for the slowest, measured against all-reduce with one rank slowed
3x (the `slow_rank` drill's rule: the rank sleeps (factor - 1) times each step's measured time).

Run: `python -m bench.run --only stragglers`; Ray tasks on this machine, no service (the shards and `Replica`s
alone, without a job's ranks: a job runs them too, docs/guide.md). The same MLP, data and seed at dp=4
in every mode, STEPS steps, AdamW: all-reduce BSP (gloo all-reduce between four Ray tasks, each stepping its own
optimizer, as data parallelism does), and a parameter server (`actors.ps_shard`, SHARDS shards) under BSP, SSP at
s=2 and ASP. A row per mode: steps per second of the whole run (STEPS over the wall time from the first step to the
last replica's end, timed inside the tasks: no process start, import or gloo rendezvous) and its ratio to
all-reduce's; and the loss after STEPS steps (the final parameters on a held-out batch) beside all-reduce's.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import ray
import torch
from trainyard.actors.ps_shard import RayTransport, ps_shards
from trainyard.parallel.config import OptimizerConfig, SyncConfig
from trainyard.parallel.optim.lr_schedules import lr_at
from trainyard.parallel.optim.optimizer import make_optimizer, set_lr
from trainyard.parallel.runtime.sync.parameter_server import Replica

from bench.context import BenchContext
from bench.results import Row, ratio

STEPS, WORKERS, SLOW_RANK, FACTOR, SHARDS, WIDTH, BATCH = 40, 4, 1, 3.0, 2, 256, 64
OPTIMIZER = OptimizerConfig(kind="adamw", lr=3e-3, warmup_steps=4, weight_decay=0.1)
MODES: dict[str, SyncConfig | None] = {
    "allreduce BSP": None,
    "PS BSP": SyncConfig(kind="parameter_server", consistency="bsp", shards=SHARDS),
    "PS SSP s=2": SyncConfig(kind="parameter_server", consistency="ssp", staleness=2, shards=SHARDS),
    "PS ASP": SyncConfig(kind="parameter_server", consistency="asp", shards=SHARDS),
}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, 16))


def share_loss(m: torch.nn.Module, step: int, worker: int) -> torch.Tensor:
    """A regression on a fixed random teacher: worker `worker`'s share of step `step`'s batch (seeded)."""
    g = torch.Generator().manual_seed(10_000 * step + worker)
    x = torch.randn(BATCH, WIDTH, generator=g)
    teacher = torch.Generator().manual_seed(99)
    w = torch.randn(WIDTH, 16, generator=teacher) / WIDTH ** 0.5
    return torch.nn.functional.mse_loss(m(x), torch.tanh(x @ w))


def held_out_loss(params: list[torch.Tensor]) -> float:
    m = model()
    with torch.no_grad():
        for p, v in zip(m.parameters(), params, strict=True):
            p.copy_(v)
        return share_loss(m, 1_000_000, 0).item()


def _stretch(worker: int):
    def stretch(step: int, elapsed: float) -> None:
        if worker == SLOW_RANK:
            time.sleep((FACTOR - 1.0) * elapsed)
    return stretch


@ray.remote(num_cpus=1)
def _ps_replica(shards: list, owner: list[int], worker: int) -> tuple[float, float]:
    """(when its first step started, when its last push was applied), timed in the task: not the process start."""
    torch.set_num_threads(1)
    transport = RayTransport(shards, owner, worker)
    replica = Replica(model(), transport, lambda m, s: share_loss(m, s, worker), before_step=_stretch(worker))
    start = time.time()
    replica.run(0, STEPS)
    transport.close()
    return start, time.time()


@ray.remote(num_cpus=1)
def _allreduce_replica(address: str, worker: int) -> tuple[float, float, list[torch.Tensor]]:
    """(when its first step started, after the gloo world formed; when its last ended; the final parameters)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=worker, world_size=WORKERS)
    m = model()
    params = list(m.parameters())
    opt = make_optimizer([(p, p) for p in params], OPTIMIZER)
    stretch = _stretch(worker)
    dist.barrier()
    begin = time.time()
    for step in range(STEPS):
        start = time.perf_counter()
        opt.zero_grad()
        share_loss(m, step, worker).backward()
        stretch(step, time.perf_counter() - start)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        dist.all_reduce(flat)
        for p, g in zip(params, torch.split(flat / WORKERS, [p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p)
        set_lr(opt, lr_at(step, OPTIMIZER, STEPS))
        opt.step()
    dist.destroy_process_group()
    return begin, time.time(), [p.detach() for p in params]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(name: str, sync: SyncConfig | None) -> dict[str, Any]:
    """(steps per second, the held-out loss after STEPS steps) of one mode."""
    if sync is None:
        address = f"tcp://127.0.0.1:{_free_port()}"
        results = ray.get([_allreduce_replica.remote(address, w) for w in range(WORKERS)])
        start, end, params = min(r[0] for r in results), max(r[1] for r in results), results[0][2]
    else:
        shards, owner = ps_shards(f"bench-{name.replace(' ', '-').replace('=', '')}", list(model().parameters()),
                                  OPTIMIZER, sync, WORKERS, STEPS)
        ray.get([s.tensors.remote() for s in shards])  # started
        spans = ray.get([_ps_replica.remote(shards, owner, w) for w in range(WORKERS)])
        start, end = min(s for s, _ in spans), max(e for _, e in spans)
        parts = [iter(t) for t in ray.get([s.tensors.remote() for s in shards])]
        params = [next(parts[o]) for o in owner]
        applied = [a for s in shards for a in ray.get(s.metrics.remote())]
        for s in shards:
            ray.kill(s)
        staleness = max(a["staleness"] for a in applied)
    return {"steps_per_s": STEPS / (end - start), "loss": held_out_loss(params),
            "staleness": 0 if sync is None else staleness}


def run_section(ctx: BenchContext) -> list[Row]:
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address="local", num_cpus=WORKERS + 1, include_dashboard=False, log_to_driver=False)
    try:
        measured = {name: run_mode(name, sync) for name, sync in MODES.items()}
    finally:
        if started_here:
            ray.shutdown()
    base = measured["allreduce BSP"]
    rows = []
    for name, m in measured.items():
        ctx.log(f"{name}: {m['steps_per_s']:.2f} steps/s, held-out loss {m['loss']:.4f}, max staleness "
                f"{m['staleness']}")
        note = (f"dp={WORKERS}, rank {SLOW_RANK} slowed {FACTOR:g}x, {STEPS} steps of a {WIDTH}-wide MLP, AdamW; "
                f"max staleness carried {m['staleness']}")
        rows.append(Row(f"{name}: steps/s with one rank {FACTOR:g}x slow", m["steps_per_s"], base["steps_per_s"],
                        ratio(m["steps_per_s"], base["steps_per_s"]), "steps/s", note))
        rows.append(Row(f"{name}: held-out loss after {STEPS} steps", m["loss"], base["loss"],
                        ratio(m["loss"], base["loss"]), "loss", note))
    return rows
