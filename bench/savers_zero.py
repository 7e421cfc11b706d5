"""Section "savers-zero": ZeRO-2 and ZeRO-3 (FSDP2, `parallel.runtime.dp.fsdp`) against zero 0, memory and step time.

Run: `python -m bench.run --only savers-zero`; spawned gloo ranks on this machine (torch alone, no Ray).

Two ranks (dp=2, one torch thread each) build one `RankTrainer` per variant (`parallel.zero` 0, 2, 3) of the
perf section's JobSpec on the same process groups and train them side by side, in an order rotating from
round to round (see `bench.perf`), so the machine's drift hits every variant alike; a time ratio is the median
of the per-round ratios. The memory rows are what rank 0 holds after a step: the reduced gradients (zero 0's
fp32 buckets, FSDP2's shards), the parameters kept between steps, and their peak during the step (the kept
shard plus the most FSDP2 held gathered: ZeRO-2 the one chunk, at pp=1 the whole model, for the step; ZeRO-3 per
block, two units at once). The section fails unless every variant's losses equal zero 0's within LOSS_RTOL.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.local_world import spawn
from trainyard.parallel.runtime.tp.local_parts import local_part
from trainyard.parallel.runtime.trainer import RankTrainer
from trainyard.parallel.spec import parse_spec

from bench.context import BenchContext
from bench.perf import MB, RANK_TIMEOUT_S, SPEC, WARMUP_STEPS, loss_mismatch, paired_ratio, rotated, step_times
from bench.results import Row, ratio
from bench.service_job import BenchError

ZEROS = (0, 2, 3)
ROUNDS = 10
LOSS_RTOL = 1e-4


def _plan(zero: int, steps: int) -> Plan:
    return make_plan(parse_spec({**SPEC, "name": f"bench-zero{zero}", "steps": steps,
                                 "parallel": {**SPEC["parallel"], "zero": zero}}))


def held_bytes(trainer: RankTrainer) -> dict[str, int]:
    """What a trainer holds after its step: reduced gradients, parameters kept, and their peak in the step."""
    grads = [t for r in trainer.reducers.values() for b in r.buckets for t in (b.flat, b.shard) if t is not None]
    grads += [g for r in trainer.reducers.values() if not r.buckets for g, _ in r.held_grads()]
    kept = sum(local_part(p).numel() * 4 for chunk in trainer.chunks for p in chunk.parameters())
    gathered = trainer.sharded.peak_gathered_bytes if trainer.sharded is not None else 0
    return {"grads": sum(t.numel() * t.element_size() for t in grads), "params": kept, "params_peak": kept + gathered}


def _rank_main(rank: int, port: int, plans: dict[int, Plan], out_dir: str) -> None:
    torch.set_num_threads(1)
    driver = RankDriver(plans[0], rank, "127.0.0.1", port, torch.device("cpu"), timeout_s=RANK_TIMEOUT_S)
    trainers = {z: driver.trainer_for(plan) for z, plan in plans.items()}
    stats: dict[int, list[dict]] = {z: [] for z in plans}
    held: dict[int, dict[str, int]] = {}
    for step in range(driver.plan.config.steps):
        share = driver.microbatches(step)
        for z in rotated(list(plans), step):
            dist.barrier()
            stats[z].append(trainers[z].train_step(step, share).to_dict())
            held[z] = held_bytes(trainers[z])
    torch.save({"stats": stats, "held": held}, Path(out_dir) / f"zero-rank{rank}.pt")
    driver.close()


def run_section(ctx: BenchContext) -> list[Row]:
    rounds = ctx.rounds or ROUNDS
    plans = {z: _plan(z, WARMUP_STEPS + rounds) for z in ZEROS}
    ctx.log(f"savers-zero: the perf section's model at dp=2, zero {', '.join(map(str, ZEROS))} side by side, "
            f"{WARMUP_STEPS} warm-up + {rounds} measured steps each")
    start = time.perf_counter()
    spawn(_rank_main, plans[0].world_size, plans, str(ctx.run_dir))
    per_rank = [torch.load(ctx.run_dir / f"zero-rank{r}.pt") for r in range(plans[0].world_size)]
    ctx.log(f"ranks done in {time.perf_counter() - start:.0f} s")
    runs = {z: [r["stats"][z] for r in per_rank] for z in ZEROS}
    losses = {z: [s["loss"] for s in stats[0]] for z, stats in runs.items()}
    mismatch = loss_mismatch(losses, 0)
    if mismatch > LOSS_RTOL:
        raise BenchError(f"savers-zero: losses differ from zero 0's by {mismatch:.1e} relative: {losses}")
    times = {z: step_times(stats, WARMUP_STEPS) for z, stats in runs.items()}
    held = per_rank[0]["held"]
    opt = {z: runs[z][0][-1]["optimizer_bytes"] for z in ZEROS}
    for z in ZEROS:
        ctx.log(f"zero {z}: median step {statistics.median(times[z]):.4f} s; rank 0 holds gradients "
                f"{held[z]['grads'] / MB:.2f} MB, parameters {held[z]['params'] / MB:.2f} MB (peak "
                f"{held[z]['params_peak'] / MB:.2f} MB), optimizer state {opt[z] / MB:.2f} MB")
    note = f"dp=2 gloo, rank 0, perf section's model; losses equal zero 0's within {mismatch:.1e} rel.; same run"
    rows: list[Row] = []
    for z in (2, 3):
        for key, title in (("grads", "reduced gradients"), ("params", "parameters between steps"),
                           ("params_peak", "parameters at the step's peak")):
            ours, base = held[z][key] / MB, held[0][key] / MB
            rows.append(Row(f"dp2 {title} per rank, zero={z} vs zero=0 (MB)", ours, base, ratio(ours, base), "MB",
                            note))
        rows.append(Row(f"dp2 AdamW state per rank, zero={z} vs zero=0 (MB)", opt[z] / MB, opt[0] / MB,
                        ratio(opt[z], opt[0]), "MB", note))
        rows.append(Row(f"dp2 step time, zero={z} vs zero=0 (median s)", statistics.median(times[z]),
                        statistics.median(times[0]), paired_ratio(times[z], times[0]), "s",
                        f"ratio: median of the {len(times[0])} per-round ratios; {note}"))
    return rows
