"""Section "pipeline": the executor against the simulator, and activation memory of GPipe vs 1F1B.

Two parts, side by side in one run:
- **schedule time vs simulated makespan.** pp=4 ranks (spawned processes on gloo, no Ray) run the real
  `parallel.runtime.pipeline.pipeline.PipelineExecutor` over the real action lists, with stages of a fixed synthetic
  cost: each chunk's forward sleeps FORWARD_S and its backward BACKWARD_S per stage (split evenly across the
  vpp chunks of interleaved-1f1b and zbv), half of it in the input's gradient and half in the weight's, so a
  split backward (zb-h1, zbv) sleeps each half in its own action, and moves a real activation tensor between
  ranks. Sleeping, not
  computing, makes the cost exact and leaves the two cores free for communication, so the ratio measures
  what the executor adds to the schedule (point-to-point messages, bookkeeping, Python) and nothing else.
  A step's time is the slowest rank's schedule wall time after a barrier; the baseline is
  `parallel.plan.schedule.schedule_sim.simulate` of the same lists with the same costs and free communication.
- **peak activation memory per stage.** A GPT pp=4 job with 8 micro-batches, run through the real
  service once with gpipe and once with 1f1b; the metrics rows report, per stage, the most bytes autograd
  held for backward at once (saved-tensor hooks, parameters excluded) and the most chunk activations.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from trainyard.parallel.plan.schedule.schedule_sim import simulate
from trainyard.parallel.plan.schedule.schedule_timing import Costs
from trainyard.parallel.plan.schedule.schedules import build_schedule, placement_of
from trainyard.parallel.runtime.local_world import spawn
from trainyard.parallel.runtime.pipeline.pipeline import PipelineExecutor

from bench.context import BenchContext
from bench.results import Row, at_most, median, ratio
from bench.service_job import TrainyardService

PP, MICROBATCHES = 4, 8
FORWARD_S, BACKWARD_S = 0.020, 0.040  # per stage and micro-batch
ACTIVATION_SHAPE = (2, 64, 64)  # a micro-batch's activation between stages: 32 KiB of fp32
STEPS, WARMUP_STEPS = 12, 2
QUICK_STEPS = 6  # `--quick`
TARGET_RATIO = 1.15
RUNS = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2))

MEMORY_SPEC: dict[str, Any] = {
    "name": "bench-pipeline-memory",
    "seed": 1234,
    "model": {"n_layer": 8, "n_head": 4, "d_model": 128, "vocab_size": 256, "seq_len": 128},
    "data": {"kind": "synthetic"},
    "steps": 3,
    "global_batch": 16,
    "parallel": {"pp": PP, "microbatches": MICROBATCHES},
    "resources": {"gpus_per_worker": 0, "cpus_per_worker": 1},
}


def run_section(ctx: BenchContext) -> list[Row]:
    rows = []
    for kind, vpp in RUNS:
        rows.append(_schedule_row(ctx, kind, vpp))
    rows += _memory_rows(ctx)
    return rows


# --- schedule time vs simulated makespan -------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class SyntheticChunk(nn.Module):
    """A pipeline chunk whose forward and backward take a fixed time; same interface as GPTStage. The
    backward's time is half on the input's path and half on the weight's, which meet in one product, so the
    input half of a split backward sleeps the first and its weight half the second."""

    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():  # the first stage gets token ids: start from a fixed activation
            x = torch.ones(ACTIVATION_SHAPE, requires_grad=True)
        return _Sleep.apply(x, self.forward_s, self.backward_s / 2) * _Sleep.apply(self.scale, 0.0,
                                                                                    self.backward_s / 2)

    def loss_sum(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return out.sum()


def _rank_main(rank: int, port: int, kind: str, vpp: int, out_dir: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=PP)
    chunks = [SyntheticChunk(FORWARD_S / vpp, BACKWARD_S / vpp) for _ in range(vpp)]
    actions = build_schedule(kind, PP, MICROBATCHES, vpp)[rank]
    executor = PipelineExecutor(chunks, rank, PP, list(range(PP)), ACTIVATION_SHAPE, torch.device("cpu"),
                                loss_scale=1.0, placement=placement_of(kind))
    tokens = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    times = []
    for _ in range(steps):
        dist.barrier()
        _, timings = executor.run(actions, lambda mb: tokens)
        times.append(timings.schedule_s)
    torch.save(times, Path(out_dir) / f"{kind}-rank{rank}.pt")
    dist.destroy_process_group()


def _schedule_row(ctx: BenchContext, kind: str, vpp: int) -> Row:
    steps = QUICK_STEPS if ctx.quick else STEPS
    spawn(_rank_main, PP, kind, vpp, str(ctx.run_dir), steps)
    per_rank = [torch.load(ctx.run_dir / f"{kind}-rank{r}.pt") for r in range(PP)]
    step_times = [max(rank_times[step] for rank_times in per_rank) for step in range(WARMUP_STEPS, steps)]
    measured = median(step_times)
    costs = Costs(forward=FORWARD_S / vpp, backward=BACKWARD_S / vpp, comm=0.0)  # W: half the backward
    sim = simulate(build_schedule(kind, PP, MICROBATCHES, vpp), MICROBATCHES, vpp, costs, placement_of(kind))
    r = ratio(measured, sim.makespan)
    ctx.log(f"pipeline {kind:<17} measured {measured:.4f} s, simulated makespan {sim.makespan:.4f} s, ratio {r:.3f}")
    return Row(f"pp{PP} m{MICROBATCHES} {kind} vpp{vpp} step time vs simulated makespan (median s)",
               measured, sim.makespan, r, "s",
               f"synthetic stages forward {FORWARD_S * 1e3:g} ms + backward "
               f"{BACKWARD_S * 1e3:g} ms per micro-batch; simulated bubble {sim.bubble_fraction:.1%}; "
               f"{len(step_times)} steps measured", target=at_most(TARGET_RATIO, of="ratio"))


# --- activation memory, GPipe vs 1F1B --------------------------------------------------------------


def _memory_rows(ctx: BenchContext) -> list[Row]:
    last_rows = {}
    with TrainyardService(ctx.run_dir / "service") as service:
        for kind in ("gpipe", "1f1b"):
            spec = {**MEMORY_SPEC, "name": f"bench-memory-{kind}",
                    "parallel": {**MEMORY_SPEC["parallel"], "schedule": kind}}
            last_rows[kind] = service.run_job(spec)[-1]
            ctx.log(f"memory {kind:<5} peak MB per stage {_mb(last_rows[kind])}, "
                    f"chunk activations {last_rows[kind]['stage_peak_activations']}")
    gpipe, one_f_one_b = last_rows["gpipe"], last_rows["1f1b"]
    return [
        Row(f"pp{PP} m{MICROBATCHES} stage {s} peak activation memory, 1f1b vs gpipe (MB)",
            one_f_one_b["stage_peak_activation_mb"][s], gpipe["stage_peak_activation_mb"][s],
            ratio(one_f_one_b["stage_peak_activation_mb"][s], gpipe["stage_peak_activation_mb"][s]), "MB",
            f"GPT 8 layers d_model 128 seq_len 128, 2 sequences per micro-batch, through the service; chunk "
            f"activations held at once 1f1b {one_f_one_b['stage_peak_activations'][s]} vs gpipe "
            f"{gpipe['stage_peak_activations'][s]}")
        for s in range(PP)
    ]


def _mb(row: dict[str, Any]) -> str:
    return "/".join(f"{v:.1f}" for v in row["stage_peak_activation_mb"])
