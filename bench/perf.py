"""Section "perf": overlapped gradient reduction, ZeRO-1 and activation checkpointing, each on vs off.

Run: `python -m bench.run --only perf`; spawned gloo ranks on this machine (torch alone, no Ray); about a
minute on 2 cores.

Two ranks (dp=2, one torch thread each) build one `RankTrainer` per variant of the same JobSpec, all on the
same process groups, and train them side by side: each round is one step of every variant, one after the
other, in an order that rotates from round to round, so drift of the machine (other tenants' load) hits
every variant alike; a time ratio is the median of the per-round ratios. Every step starts after a
barrier; a step's time is the slower rank's `compute_s` (the time inside `train_step`). The first
WARMUP_STEPS steps of each variant are not measured.

The variants differ in one field each from `base` (overlap_reduce true, zero 0, no checkpointing; gloo's collectives,
`shared_memory_reduce: false`, since overlap is what the section weighs: the dp section measures shared memory):
- `no-overlap`: `parallel.overlap_reduce: false`, every bucket all-reduced after backward;
- `zero1`: `parallel.zero: 1`, gradients reduce-scattered, AdamW state for this rank's half only
  (`StepStats.optimizer_bytes`), parameters all-gathered after the step;
- `full`, `selective`: `activation_checkpointing`; `StepStats.peak_activation_bytes` is the most bytes
  autograd held for backward at once (the pipeline executor's saved-tensor meter, parameters excluded).
All variants do the same math from the same weights and samples: the section fails (no rows) unless every
step's loss of every variant equals `base`'s within LOSS_RTOL.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.local_world import spawn
from trainyard.parallel.spec import parse_spec

from bench.context import BenchContext
from bench.machine import busy_fraction
from bench.results import Row, ratio
from bench.service_job import BenchError

MODEL = {"n_layer": 6, "n_head": 6, "d_model": 384, "vocab_size": 256, "seq_len": 128}
SPEC: dict[str, Any] = {
    "name": "bench-perf",
    "seed": 1234,
    "model": MODEL,
    "data": {"kind": "synthetic"},
    "global_batch": 4,  # few tokens per rank, so the 42 MiB gradient all-reduce is a visible share of a step
    "parallel": {"dp": 2, "overlap_reduce": True, "zero": 0, "shared_memory_reduce": False},
    "activation_checkpointing": "none",
    "resources": {"gpus_per_worker": 0},
}
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "no-overlap": {"parallel": {"overlap_reduce": False}},
    "zero1": {"parallel": {"zero": 1}},
    "full": {"activation_checkpointing": "full"},
    "selective": {"activation_checkpointing": "selective"},
}
ROUNDS = 20
COLLECTIVE_ROUNDS = 5
WARMUP_STEPS = 1
LOSS_RTOL = 1e-5
RANK_TIMEOUT_S = 300
MB = 2**20

Stats = list[list[dict[str, Any]]]  # one variant's StepStats dicts, indexed [rank][step]


def variant_spec(name: str, steps: int) -> dict[str, Any]:
    """SPEC with variant `name`'s fields changed (one level deep, as `parallel` is merged)."""
    spec = {**SPEC, "steps": steps}
    for key, value in VARIANTS[name].items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    return spec


def rotated(names: Sequence[str], round_no: int) -> list[str]:
    """The order of round `round_no`: the names rotated by the round, so each runs in every position."""
    k = round_no % len(names) if names else 0
    return [*names[k:], *names[:k]]


def step_times(stats: Stats, warmup: int) -> list[float]:
    """Each measured step's time: the slower rank's compute_s (a step ends when both ranks are done)."""
    return [max(rank[step]["compute_s"] for rank in stats) for step in range(warmup, len(stats[0]))]


def paired_ratio(times: Sequence[float], versus: Sequence[float]) -> float:
    """The median over rounds of times[i] / versus[i]: both ran within seconds of each other in round i, so
    the machine's drift (others' load comes and goes over tens of seconds) cancels out of each ratio."""
    return statistics.median(t / v for t, v in zip(times, versus, strict=True))


def loss_mismatch(losses: dict[str, list[float]], reference: str) -> float:
    """The largest relative difference of any variant's loss from the reference's at the same step."""
    ref = losses[reference]
    return max((abs(x - r) / abs(r) for values in losses.values() for x, r in zip(values, ref, strict=True)),
               default=0.0)


def _rank_main(rank: int, port: int, plans: dict[str, Plan], out_dir: str) -> None:
    start = time.perf_counter()
    torch.set_num_threads(1)
    driver = RankDriver(plans["base"], rank, "127.0.0.1", port, torch.device("cpu"), timeout_s=RANK_TIMEOUT_S)
    # One trainer per variant, all on the same groups (the layouts are equal): the steps interleave, and
    # each trainer's collectives are done before the next one's start (finish() waits for them).
    trainers = {name: driver.trainer_for(plan) for name, plan in plans.items()}
    stats: dict[str, list[dict]] = {name: [] for name in plans}
    setup_s = time.perf_counter() - start
    for step in range(driver.plan.config.steps):
        share = driver.microbatches(step)
        for name in rotated(list(plans), step):
            dist.barrier()
            stats[name].append(trainers[name].train_step(step, share).to_dict())
    numel = sum(p.numel() for p in trainers["base"].chunks[0].parameters())
    collectives = _collective_times(numel, rounds=COLLECTIVE_ROUNDS)
    torch.save({"setup_s": setup_s, "stats": stats, "collectives": collectives},
               Path(out_dir) / f"perf-rank{rank}.pt")
    driver.close()


def _collective_times(numel: int, rounds: int) -> dict[str, float]:
    """Median seconds of each collective the two reductions use, on one flat fp32 tensor of `numel`
    elements (the whole model's gradients in one bucket), each after a barrier."""
    grads, shard, whole = torch.ones(numel), torch.empty(numel // 2), torch.empty(numel // 2 * 2)
    ops = {"all_reduce": lambda: dist.all_reduce(grads),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, grads[:shard.numel() * 2]),
           "all_gather": lambda: dist.all_gather_into_tensor(whole, shard)}
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


@dataclass(frozen=True)
class Measured:
    runs: dict[str, Stats]
    """Each variant's StepStats dicts, [rank][step]."""
    collectives: dict[str, float]
    """Rank 0's median seconds of each collective on all the gradients at once (see _collective_times)."""
    setup_s: float
    """The slower rank's start-up: rendezvous, building the trainers."""


def run_variants(run_dir: Path, rounds: int) -> Measured:
    """Train every variant for WARMUP_STEPS + rounds steps side by side, then time the collectives."""
    plans = {name: make_plan(parse_spec(variant_spec(name, WARMUP_STEPS + rounds))) for name in VARIANTS}
    world = plans["base"].world_size
    spawn(_rank_main, world, plans, str(run_dir))
    per_rank = [torch.load(run_dir / f"perf-rank{r}.pt") for r in range(world)]
    return Measured(runs={name: [per_rank[r]["stats"][name] for r in range(world)] for name in plans},
                    collectives=per_rank[0]["collectives"], setup_s=max(r["setup_s"] for r in per_rank))


def run_section(ctx: BenchContext) -> list[Row]:
    rounds = ctx.rounds or ROUNDS
    cfg = parse_spec(variant_spec("base", 1))
    params = sum(p.numel() for p in full_model(cfg.model, cfg.seed).parameters())
    ctx.log(f"perf: GPT {_model_text()}, {params / 1e6:.1f}M parameters, global_batch {SPEC['global_batch']}, "
            f"dp=2; variants {', '.join(VARIANTS)}; {WARMUP_STEPS} warm-up + {rounds} measured steps each")
    busy = busy_fraction() or 0.0
    ctx.log(f"machine {100 * busy:.0f}% busy before the run (others' load; high means noisy timings)")
    start = time.perf_counter()
    measured = run_variants(ctx.run_dir, rounds)
    runs = measured.runs
    ctx.log(f"ranks done in {time.perf_counter() - start:.0f} s (start-up {measured.setup_s:.0f} s)")
    losses = {name: [s["loss"] for s in stats[0]] for name, stats in runs.items()}  # dp rank 0: the global loss
    (ctx.run_dir / "perf.json").write_text(json.dumps({"runs": runs, "collectives": measured.collectives}))
    mismatch = loss_mismatch(losses, "base")
    if mismatch > LOSS_RTOL:
        raise BenchError(f"perf: the variants' losses differ from base's by {mismatch:.1e} relative "
                         f"(> {LOSS_RTOL:g}): {losses}")
    times = {name: step_times(stats, WARMUP_STEPS) for name, stats in runs.items()}
    for name, stats in runs.items():
        ctx.log(f"{name:<10} median step {statistics.median(times[name]):.4f} s (rank 0: {_parts(stats)}), optimizer "
                f"state {_mb(stats, 'optimizer_bytes')} MB, peak activations {_mb(stats, 'peak_activation_bytes')} "
                f"MB per rank")
    ctx.log("gloo on all the gradients at once: " + ", ".join(f"{name} {t:.4f} s"
                                                              for name, t in measured.collectives.items()))
    ctx.log(f"losses of all variants equal base's within {mismatch:.1e} relative")
    return _rows(runs, times, mismatch, params, busy) + [_collective_row(measured.collectives, params)]


def _collective_row(times: dict[str, float], params: int) -> Row:
    zero = times["reduce_scatter"] + times["all_gather"]
    return Row("dp2 gloo collectives on all gradients, ZeRO-1's reduce-scatter + all-gather vs all-reduce "
               "(median s)", zero, times["all_reduce"], ratio(zero, times["all_reduce"]), "s",
               f"one flat fp32 tensor of {params / 1e6:.1f}M elements ({4 * params / MB:.0f} MB), "
               f"{COLLECTIVE_ROUNDS} times each after a barrier, after the steps: reduce-scatter "
               f"{times['reduce_scatter']:.4f} s, all-gather {times['all_gather']:.4f} s")


def _rows(runs: dict[str, Stats], times: dict[str, list[float]], mismatch: float, params: int,
          busy: float) -> list[Row]:
    med = {name: statistics.median(t) for name, t in times.items()}
    n = len(times["base"])
    first = (f"GPT {_model_text()} ({params / 1e6:.1f}M params), dp=2 gloo, 1 thread per rank, global_batch "
             f"{SPEC['global_batch']}; the 5 variants side by side, {n} measured steps each, order rotating; losses "
             f"equal base's within {mismatch:.1e} rel.; machine {100 * busy:.0f}% busy before the run")

    def time_row(title: str, name: str, versus: str, note: str = "same run") -> Row:
        per_round = [t / v for t, v in zip(times[name], times[versus], strict=True)]
        q1, _, q3 = statistics.quantiles(per_round, n=4)
        return Row(f"{title} (median s)", med[name], med[versus], paired_ratio(times[name], times[versus]), "s",
                   f"ratio: median of the {n} per-round ratios, middle half {q1:.3f}-{q3:.3f} (ratio of the "
                   f"medians {ratio(med[name], med[versus]):.3f}); {note}")

    def bytes_row(title: str, name: str, versus: str, key: str) -> Row:
        ours, base = _rank_max(runs[name], 0, key) / MB, _rank_max(runs[versus], 0, key) / MB
        rank1 = f"{_rank_max(runs[name], 1, key) / MB:.3f} vs {_rank_max(runs[versus], 1, key) / MB:.3f}"
        return Row(f"{title} (MB)", ours, base, ratio(ours, base), "MB", f"rank 0 (rank 1: {rank1}); same run")

    return [
        time_row("dp2 step time, overlap_reduce true vs false", "base", "no-overlap",
                 f"rank 0 with vs without overlap: {_parts(runs['base'])} vs {_parts(runs['no-overlap'])}; {first}"),
        bytes_row("dp2 AdamW state per rank, zero=1 vs zero=0", "zero1", "base", "optimizer_bytes"),
        time_row("dp2 step time, zero=1 vs zero=0", "zero1", "base"),
        bytes_row("peak activation memory per rank, checkpointing full vs none", "full", "base",
                  "peak_activation_bytes"),
        bytes_row("peak activation memory per rank, checkpointing selective vs none", "selective", "base",
                  "peak_activation_bytes"),
        time_row("step time, checkpointing full vs none", "full", "base"),
        time_row("step time, checkpointing selective vs none", "selective", "base"),
    ]




def _model_text() -> str:
    return (f"{MODEL['n_layer']} layers, d_model {MODEL['d_model']}, seq_len {MODEL['seq_len']}, "
            f"vocab {MODEL['vocab_size']}")


def _rank_max(stats: Stats, rank: int, key: str) -> int:
    """The most of `key` over the steps of `rank` (bytes are the same every step)."""
    return max(s[key] for s in stats[rank])


def _mb(stats: Stats, key: str) -> str:
    return "/".join(f"{_rank_max(stats, r, key) / MB:.2f}" for r in range(len(stats)))


def _parts(stats: Stats) -> str:
    """Rank 0's median forward, backward and the rest of its steps (reduction wait, clipping, AdamW, ZeRO's
    all-gather, the loss all-reduce)."""
    measured = stats[0][WARMUP_STEPS:]
    forward = statistics.median(s["forward_s"] for s in measured)
    backward = statistics.median(s["backward_s"] for s in measured)
    rest = statistics.median(s["compute_s"] - s["forward_s"] - s["backward_s"] for s in measured)
    return f"forward {forward:.3f}, backward {backward:.3f}, after backward {rest:.3f} s"
