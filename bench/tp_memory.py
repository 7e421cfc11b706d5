"""The last pipeline stage's peak activation memory at tp=1 vs tp=2, for a model whose logits dominate.

Run: `python -m bench.tp_memory`, or as the section `tensor` of `make bench` (`python -m bench.run --only
tensor`); spawned gloo ranks on this machine, no Ray; about a minute on 2 cores.

A GPT with a large vocabulary and a short, narrow trunk (vocab 8192, seq_len 128, d_model 64, two blocks)
trains one step with pp=2 (1f1b, two micro-batches) at tp=1, tp=2 and tp=2 with sp. Each rank's
`RankTrainer` reports `peak_activation_bytes`: the most bytes autograd held for backward at once, counted
by the pipeline executor's saved-tensor meter (parameters excluded; a DTensor counts its local shard),
which the service shows as `stage_peak_activation_mb`. The last stage holds the head and the cross-entropy,
so its peak is mostly logits; with the head sharded over the vocabulary and `loss_parallel`, no rank holds
a token's whole row of logits and the peak should fall by about tp.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from api.spec import parse_spec
from bench.context import BenchContext
from bench.results import Row, ratio
from bench.service_job import free_port
from parallel.data import open_dataset, step_microbatches
from parallel.distributed import init_distributed, shutdown_distributed
from parallel.plan import Plan, make_plan
from parallel.trainer import RankTrainer

SPEC = {
    "name": "bench-tp-memory",
    "seed": 1234,
    "model": {"n_layer": 2, "n_head": 4, "d_model": 64, "vocab_size": 8192, "seq_len": 128},
    "data": {"kind": "synthetic"},
    "steps": 1,
    "global_batch": 8,
    "resources": {"gpus_per_worker": 0},
}
LAYOUTS = {"tp=1": {"tp": 1}, "tp=2": {"tp": 2}, "tp=2 sp": {"tp": 2, "sp": True}}
PIPELINE = {"pp": 2, "microbatches": 2, "schedule": "1f1b"}


def _rank_main(rank: int, plan: Plan, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    groups = init_distributed(plan, rank, "127.0.0.1", port, torch.device("cpu"), timeout_s=300)
    trainer = RankTrainer(plan, rank, groups, torch.device("cpu"))
    cfg = plan.config
    stats = trainer.train_step(0, step_microbatches(plan, rank, 0, open_dataset(cfg).num_samples))
    torch.save(stats.to_dict(), Path(out_dir) / f"rank{rank}.pt")
    shutdown_distributed()


def stage_peaks_mb(parallel: dict) -> list[float]:
    """Peak saved-activation MB of each pipeline stage (tp rank 0; its peers hold the same)."""
    plan = make_plan(parse_spec({**SPEC, "parallel": {**PIPELINE, **parallel}}))
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_main, args=(plan, free_port(), out), nprocs=plan.world_size, start_method="spawn")
        stats = [torch.load(Path(out) / f"rank{r}.pt") for r in range(plan.world_size)]
    by_stage = sorted((s for s in stats if s["dp_rank"] == 0 and s["tp_rank"] == 0), key=lambda s: s["pp_rank"])
    return [s["peak_activation_bytes"] / 2**20 for s in by_stage]


def run_section(ctx: BenchContext) -> list[Row]:
    peaks = {name: stage_peaks_mb(parallel) for name, parallel in LAYOUTS.items()}
    base = peaks["tp=1"]
    for name, per_stage in peaks.items():
        ctx.log(f"{name}: peak saved activations per stage {[round(mb, 2) for mb in per_stage]} MB")
    m = SPEC["model"]
    note = (f"GPT vocab {m['vocab_size']}, seq_len {m['seq_len']}, d_model {m['d_model']}, {m['n_layer']} blocks, "
            f"pp=2 1f1b, 2 micro-batches of 4; baseline tp=1")
    return [Row(f"last-stage peak activation memory, {name} vs tp=1 (MB)", peaks[name][-1], base[-1],
                ratio(peaks[name][-1], base[-1]), "MB", note) for name in ("tp=2", "tp=2 sp")] + [
            Row(f"first-stage peak activation memory, {name} vs tp=1 (MB)", peaks[name][0], base[0],
                ratio(peaks[name][0], base[0]), "MB", note) for name in ("tp=2", "tp=2 sp")]


def main() -> None:
    m = SPEC["model"]
    print(f"model: vocab {m['vocab_size']}, seq_len {m['seq_len']}, d_model {m['d_model']}, {m['n_layer']} blocks; "
          f"pp={PIPELINE['pp']} {PIPELINE['schedule']}, {PIPELINE['microbatches']} micro-batches of "
          f"{SPEC['global_batch'] // PIPELINE['microbatches']} sequences")
    peaks = {name: stage_peaks_mb(parallel) for name, parallel in LAYOUTS.items()}
    base = peaks["tp=1"][-1]
    for name, per_stage in peaks.items():
        stages = ", ".join(f"stage {i}: {mb:.2f} MB" for i, mb in enumerate(per_stage))
        print(f"{name:8} {stages}; last stage vs tp=1: {per_stage[-1] / base:.3f}")


if __name__ == "__main__":
    main()
