"""Section "planner": the planner's predicted step times against measured ones, over a grid of layouts.

Run: `python -m bench.planner` (= `python -m bench.run --only planner`: the rows go to bench/results.json; about ten
minutes on 2 busy cores). Calibrates this machine first (`parallel.runtime.calibrate.measure`: matmuls, optimizer,
the collectives at a few sizes, compute's slowdown with 1-4 ranks busy at once, and the trainer's fixed costs on
tiny models; nothing of the grid below), then for each of two model sizes runs a grid of 18 layouts of 1, 2 or 4
ranks (dp, pp with gpipe / 1f1b / interleaved / zb-h1, tp with and without sp, their products, micro-batches,
ZeRO-1, activation checkpointing) plus the planner's own choice for the cluster the service reports here (one node
of 4 logical CPUs on 2 cores, as `trainyard serve --num-cpus 4`), in one spawned gloo world
(`parallel.runtime.local_world.run_plans`). The layouts are run round-robin, REPEATS times each, so a burst of load
from other processes falls on all of them rather than on one; a layout's step time is the median over its repeats'
steps after each run's first (a step: the slowest rank's `compute_s`). Compared: Spearman's rank correlation of
predicted vs measured step time (the Done-when wants >= 0.8) and the chosen layout's measured time over the fastest
measured (<= 1.10), as rows with those targets; and a row per layout, its measured step time against the predicted
one. The load average is printed before and after each size, and kept in the notes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from trainyard.parallel.config import JobConfig
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.admission import ClusterResources, NodeResources
from trainyard.parallel.plan.planner.calibration import quartile
from trainyard.parallel.plan.planner.machine_costs import MachineCosts
from trainyard.parallel.plan.planner.planner import choose
from trainyard.parallel.plan.planner.prediction import predict_step
from trainyard.parallel.runtime.calibrate import measure
from trainyard.parallel.runtime.local_world import PlanRun, run_plans
from trainyard.parallel.spec import parse_spec

from bench.results import Row, at_least, at_most, ratio

STEPS = 5
"""Steps per run (the first of each run is not counted)."""
REPEATS = 4
"""Runs of each layout, round-robin over the grid."""
SIZES = {
    "small": {"n_layer": 4, "n_head": 4, "d_model": 128, "vocab_size": 256, "seq_len": 64},
    "medium": {"n_layer": 4, "n_head": 8, "d_model": 384, "vocab_size": 512, "seq_len": 128},
}
GLOBAL_BATCH = 8
GRID: list[dict] = [
    {"parallel": {}},
    {"parallel": {"microbatches": 4}},
    {"parallel": {}, "activation_checkpointing": "selective"},
    {"parallel": {"dp": 2}},
    {"parallel": {"dp": 2, "microbatches": 2}},
    {"parallel": {"dp": 2, "zero": 1}},
    {"parallel": {"dp": 2}, "activation_checkpointing": "full"},
    {"parallel": {"pp": 2, "microbatches": 2, "schedule": "gpipe"}},
    {"parallel": {"pp": 2, "microbatches": 4}},
    {"parallel": {"pp": 2, "microbatches": 8}},
    {"parallel": {"pp": 2, "vpp": 2, "microbatches": 4, "schedule": "interleaved-1f1b"}},
    {"parallel": {"pp": 2, "microbatches": 4, "schedule": "zb-h1"}},
    {"parallel": {"tp": 2}},
    {"parallel": {"tp": 2, "sp": True}},
    {"parallel": {"dp": 4}},
    {"parallel": {"dp": 2, "pp": 2, "microbatches": 2}},
    {"parallel": {"pp": 4, "microbatches": 4}},
    {"parallel": {"dp": 2, "tp": 2}},
]
NODE_RANKS = 4
SPEARMAN_TARGET = 0.8
"""The Done-when's bars: Spearman's rho of predicted vs measured step times at least this, ..."""
CHOSEN_TARGET = 1.1
"""... the chosen layout's measured step at most this times the fastest measured, ..."""
PLANNING_TARGET_S = 2.0
"""... and a 7B Llama on 1024 GPUs planned within this many seconds."""
RAW = Path(__file__).parent / ".runs" / "planner.json"
CLUSTER = ClusterResources(nodes=(NodeResources(cpus=NODE_RANKS, gpus=0, memory=8 * 2**30),))


def _config(model: dict, variant: dict) -> JobConfig:
    return parse_spec({"model": model, "steps": STEPS, "global_batch": GLOBAL_BATCH, **variant})


def _label(config: JobConfig) -> str:
    p = config.parallel
    text = f"dp{p.dp} pp{p.pp} tp{p.tp}" + (" sp" if p.sp else "") + f" m{p.microbatches}"
    if p.pp > 1:
        text += f" {p.schedule}" + (f" vpp{p.vpp}" if p.vpp > 1 else "")
    if p.zero:
        text += f" zero{p.zero}"
    if config.activation_checkpointing != "none":
        text += f" ckpt-{config.activation_checkpointing}"
    if config.optimizer.offload:
        text += " optimizer-offload"
    if config.activation_offload:
        text += " activation-offload"
    return text


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def measure_size(model: dict, machine: MachineCosts, log=print) -> dict:
    """Predicted and measured step times of the grid and of the planner's choice for one model size."""
    chosen, _ = choose(_config(model, {"parallel": "auto"}), CLUSTER, machine)
    configs = [_config(model, v) for v in GRID]
    labels = [_label(c) for c in configs]
    if _label(chosen) not in labels:
        configs.append(chosen)
        labels.append(_label(chosen))
    plans = [make_plan(c) for c in configs]
    predicted = [predict_step(p.config, p.layout, machine, node_gpus=NODE_RANKS) for p in plans]
    load_before = os.getloadavg()[0]
    results = run_plans([PlanRun(plan=p) for _ in range(REPEATS) for p in plans])  # round-robin
    load_after = os.getloadavg()[0]
    steps = [[max(rank.stats[s]["compute_s"] for rank in ranks) for ranks in results[i::len(plans)]
              for s in range(1, STEPS)] for i in range(len(plans))]
    RAW.parent.mkdir(parents=True, exist_ok=True)  # every step time, for a later look (not in git)
    RAW.with_name(f"planner-{model['d_model']}.json").write_text(json.dumps(
        {"model": model, "labels": labels, "predicted": predicted, "load": [load_before, load_after],
         "machine": machine.to_dict(), "steps": steps}))
    chosen_at = labels.index(_label(chosen))
    out = {"labels": labels, "predicted": predicted, "chosen": labels[chosen_at], "load": (load_before, load_after),
           "min": [min(t) for t in steps], "max": [max(t) for t in steps]}
    for stat, fn in (("median", statistics.median), ("quartile", quartile)):
        measured = [fn(t) for t in steps]
        best = min(measured)
        out[stat] = {"measured": measured, "spearman": spearman(predicted, measured),
                     "chosen_over_fastest": measured[chosen_at] / best, "fastest": labels[measured.index(best)]}
    log("| layout | predicted ms | measured ms, median | lower quartile | min-max |\n|---|---:|---:|---:|---:|")
    for i, label in enumerate(labels):
        mark = " (chosen by the planner)" if i == chosen_at else ""
        log(f"| {label}{mark} | {predicted[i] * 1e3:.1f} | {out['median']['measured'][i] * 1e3:.1f} | "
            f"{out['quartile']['measured'][i] * 1e3:.1f} | {min(steps[i]) * 1e3:.0f}-{max(steps[i]) * 1e3:.0f} |")
    return out


def describe(m: MachineCosts) -> str:
    """The calibrated terms in one line."""
    ms = 1e3

    def fit(name: str, f) -> str:  # noqa: ANN001 - a Fit or None
        return f"{name} {f.latency_s * ms:.2f} ms + {f.per_s / 1e9:.2f} GB/s; " if f else ""

    flops = ", ".join(f"d{w:.0f} {r / 1e9:.1f}" for w, r in m.model_flops)
    zero = ", ".join(f"zero{z} +{a * ms:.2f} ms/block/step +{b * ms:.2f} ms/block/micro-batch"
                     for z, (a, b) in m.zero_fixed.items())
    return (f"matmul {m.matmul.per_s / 1e9:.1f} GFLOP/s; trainer GFLOP/s by width: {flops or '-'}; "
            f"{fit('all-reduce', m.allreduce)}{fit('all-gather', m.allgather)}"
            f"{fit('reduce-scatter', m.reducescatter)}{fit('p2p', m.p2p)}{zero + '; ' if zero else ''}"
            f"fixed: block {m.block_s * ms:.2f} ms, micro-batch {m.microbatch_s * ms:.2f} ms, step "
            f"{m.step_s * ms:.2f} ms, tp block +{m.tp_block_s * ms:.2f} ms, sp block +{m.sp_block_s * ms:.2f} ms, "
            f"pp micro-batch +{m.pp_microbatch_s * ms:.2f} ms, dp step +{m.dp_step_s * ms:.2f} ms, "
            f"backward share {m.backward_share:.2f}; contention 1-{len(m.contention)} ranks "
            + ", ".join(f"{c:.2f}" for c in m.contention)
            + (f"; all-reduce contention 1-{len(m.comm_contention)} ranks "
               + ", ".join(f"{c:.2f}" for c in m.comm_contention) if m.comm_contention else ""))


def run_section(ctx) -> list[Row]:  # noqa: ANN001 - BenchContext
    return _rows(ctx.log)


def planning_time_1024() -> tuple[float, float]:
    """(wall, CPU) seconds the planner takes for a Llama-7B-like model on 128 nodes of 8 80-GiB GPUs (default GPU
    costs): on a loaded machine the wall time is mostly waiting for a core, the CPU time is the planner's."""
    from trainyard.parallel.config import ModelConfig
    from trainyard.parallel.plan.planner.machine_costs import default_gpu_costs
    from trainyard.parallel.plan.planner.planner import plan_layouts

    llama = JobConfig(model=ModelConfig(family="llama", n_layer=32, n_head=32, d_model=4096, vocab_size=32000,
                                        seq_len=4096), steps=1, global_batch=1024, precision="bf16")
    cluster = ClusterResources(nodes=(NodeResources(cpus=64, gpus=8, memory=2**40, gpu_memory=80 * 2**30),) * 128)
    start, cpu = time.perf_counter(), time.process_time()
    plan_layouts(llama, cluster, default_gpu_costs())
    return time.perf_counter() - start, time.process_time() - cpu


def calibration_rows(machine: MachineCosts, seconds: float, load: tuple[float, float]) -> list[Row]:
    """What the predictions stand on: the calibration's time and terms, and compute's slowdown per busy rank."""
    rows = [Row("planner calibration: seconds to calibrate this machine", seconds, None, None, "s",
                f"load {load[0]:.1f} -> {load[1]:.1f}; {describe(machine)}")]
    for k, slowdown in enumerate(machine.contention[1:], start=2):
        rows.append(Row(f"planner calibration: compute slowdown with {k} ranks busy at once vs 1", slowdown, None,
                        None, "x", "an MLP block's training step; median over rounds of the slowest of the k ranks "
                                   "over the same round's one rank alone"))
    return rows


def layout_rows(name: str, r: dict) -> list[Row]:
    """One row per layout of a size's grid: the measured median step against the predicted one."""
    rows = []
    for i, label in enumerate(r["labels"]):
        measured, predicted = r["median"]["measured"][i], r["predicted"][i]
        chosen = "; the planner's choice" if label == r["chosen"] else ""
        rows.append(Row(f"planner layout {name}: {label} (median ms)",
                        measured * 1e3, predicted * 1e3, ratio(measured, predicted), "ms",
                        f"lower quartile {r['quartile']['measured'][i] * 1e3:.1f} ms; min-max "
                        f"{r['min'][i] * 1e3:.0f}-{r['max'][i] * 1e3:.0f} ms{chosen}"))
    return rows


def _rows(log) -> list[Row]:  # noqa: ANN001
    seconds, cpu = planning_time_1024()
    log(f"planning a 7B Llama on 1024 GPUs: {seconds:.2f} s wall, {cpu:.2f} s CPU (a fresh process: no schedule "
        f"cached; load {os.getloadavg()[0]:.1f})")
    rows = [Row("planner: time to plan a 7B Llama on 1024 GPUs", seconds, None, None, "s",
                f"fresh caches; {cpu:.2f} s of CPU time; load {os.getloadavg()[0]:.1f}",
                target=at_most(PLANNING_TARGET_S))]
    layouts = []
    start, load = time.perf_counter(), os.getloadavg()[0]
    machine = measure(2, "bench", node_ranks=NODE_RANKS)
    seconds, load_after = time.perf_counter() - start, os.getloadavg()[0]
    log(f"calibrated in {seconds:.0f} s (load {load:.1f} -> {load_after:.1f}): {describe(machine)}")
    rows += calibration_rows(machine, seconds, (load, load_after))
    for name, model in SIZES.items():
        log(f"{name}: {model}")
        r = measure_size(model, machine, log)
        for stat in ("median", "quartile"):
            q = r[stat]
            log(f"{name} ({stat} steps): Spearman {q['spearman']:.2f} over {len(r['labels'])} layouts; chosen "
                f"{r['chosen']} is {q['chosen_over_fastest']:.2f}x the fastest measured ({q['fastest']})")
            note = (f"{len(r['labels'])} layouts of 1-4 CPU ranks, gloo, {stat} of {REPEATS * (STEPS - 1)} steps; "
                    f"load {r['load'][0]:.1f} -> {r['load'][1]:.1f}")
            rows.append(Row(f"planner {name}: Spearman predicted vs measured step time ({stat})", q["spearman"],
                            None, None, "rho", note, target=at_least(SPEARMAN_TARGET)))
            rows.append(Row(f"planner {name}: chosen layout / fastest measured ({stat})", q["chosen_over_fastest"],
                            None, None, "x", f"chosen {r['chosen']}, fastest {q['fastest']}",
                            target=at_most(CHOSEN_TARGET)))
        layouts += layout_rows(name, r)
    return rows + layouts


if __name__ == "__main__":  # the section through bench.run, so that its rows are written like every section's
    from bench.run import main

    sys.exit(main(["--only", "planner", *sys.argv[1:]]))
