"""`make bench` (`python -m bench.run [--only SECTION ...]`): run benchmark sections, write bench/results.json.

`make bench-quick` (`python -m bench.run --quick`): a pass in under 5 minutes on a 2-core machine, to see that
every quick section runs and roughly where its numbers lie: the sections but faults, elastic and soak (minutes of
service restarts and resizes), one round each (two where a median of one says nothing: perf, checkpoint),
fewer pipeline steps; written to bench/results-quick.json, so the full run's results stay as they are.

A section is a function `BenchContext -> list[Row]` registered in SECTIONS; add one there to extend the
harness. Re-running some sections with --only replaces their rows in results.json and keeps the others'.
The machine (cores, CPU model, RAM, torch/ray versions) is read at run time, printed and stored too.
Never run in CI: the numbers are this machine's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainyard.cli.client import ApiError

from bench import (
    checkpoint,
    cp_memory,
    data,
    dp,
    elastic,
    families,
    faults,
    perf,
    pipeline,
    poll,
    savers_grads,
    scale,
    scale_predictions,
    service_ops,
    signals,
    soak,
    step,
    stragglers,
    sync,
    tinker,
    tp_memory,
)
from bench import planner as planner_bench
from bench.context import BENCH, BenchContext
from bench.machine import describe, machine_info
from bench.results import Row, load, markdown_table, merge, save
from bench.savers_optim import run_section as savers_optim
from bench.savers_zero import run_section as savers_zero_section
from bench.service_job import BenchError

RESULTS = BENCH / "results.json"
QUICK_RESULTS = BENCH / "results-quick.json"
QUICK_SECTIONS = ("dp", "pipeline", "tensor", "perf", "checkpoint", "service")
QUICK_ROUNDS = {"perf": 2, "checkpoint": 2}  # the others: 1
RUNS = BENCH / ".runs"  # scratch: service state dirs, logs, raw per-step records (git-ignored)


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    run: Callable[[BenchContext], list[Row]]


SECTIONS: dict[str, Section] = {
    s.name: s for s in (
        Section("dp", "data parallel dp=2: trainyard service vs torchrun + DDP", dp.run_section),
        Section("pipeline", "pp=4 executor vs simulated makespan; activation memory GPipe vs 1F1B",
                pipeline.run_section),
        Section("tensor", "last-stage (logits) activation memory at tp=2 vs tp=1", tp_memory.run_section),
        Section("cp", "each rank's activation peak at cp=2 and cp=4 vs cp=1 (ring attention, head-tail chunks); the "
                      "memory plan's figure; per-rank attention compute at cp=4", cp_memory.run_section),
        Section("perf", "overlapped reduction, ZeRO-1 and activation checkpointing, each on vs off (dp=2)",
                perf.run_section),
        Section("checkpoint", "checkpoint save blocking time sync vs async, save/load throughput (dp=2)",
                checkpoint.run_section),
        Section("faults", "recovery from fault drills (kill, hang a rank, kill the coordinator), hang detection and "
                          "service restarts (SIGTERM, SIGKILL), through the service", faults.run_section),
        Section("elastic", "the pause of a resize dp 2 <-> 4, state moved in memory vs through a checkpoint",
                elastic.run_section),
        Section("service", "submit latency under a burst of 200; exit time on SIGTERM", service_ops.run_section),
        Section("data", "prepare tokens/s; loader tokens/s per rank vs what a step consumes", data.run_section),
        Section("families", "a llama step vs a gpt2 step at equal parameter count", families.run_section),
        Section("step", "trainyard's one-rank step vs a plain torch loop of the same model and data; the loss's peak "
                        "bytes", step.run_section),
        Section("signals", "SIGTERM to the service's process group vs to its process", signals.run_section),
        Section("poll", "a poll at step 20,000 vs early; resume_from of a 2 GiB checkpoint", poll.run_section),
        Section("savers-zero", "ZeRO-2 and ZeRO-3 vs zero 0 (dp=2): memory and step time", savers_zero_section),
        Section("savers_grads", "powersgd vs uncompressed; compile vs eager", savers_grads.run_section),
        Section("savers-optim", "adamw8bit, adafactor, optimizer and activation offload vs off", savers_optim),
        Section("planner", "the planner's predicted vs measured step times over a grid of layouts",
                planner_bench.run_section),
        Section("sync", "diloco and local SGD vs all-reduce (dp=4; dp=2 pp=2): loss at equal tokens vs bytes "
                        "across replicas", sync.run_section),
        Section("stragglers", "all-reduce BSP vs a parameter server (BSP, SSP s=2, ASP) at dp=4 with one rank 3x "
                              "slow: steps/s and loss after N steps", stragglers.run_section),
        Section("soak", "four jobs (dp, pp x dp, tp, MoE) through a seeded fault every 20 s on a two-node cluster, "
                        "1,000 queued submits from four users mid-way: recoveries, bit-identical losses, nothing left",
                soak.run_section),
        Section("tinker", "the Tinker API's round trip vs a batch job's step; sampling vs transformers generate",
                tinker.run_section),
        Section("scale", "a 501M llama at dp=4 zero=3, built on the meta device: each rank's peak RSS vs the plan",
                scale.run_section),
        Section("predictions", "the planner's predictions on device profiles beside published large runs "
                               "(torchtitan on H100s, Megatron-LM on A100s), each with its source",
                scale_predictions.run_section),
    )
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    default = QUICK_SECTIONS if args.quick else SECTIONS
    names = list(dict.fromkeys(args.only or default))  # registry order, each once
    start = time.perf_counter()
    machine = machine_info()
    print(f"machine: {describe(machine)}", flush=True)
    run_root = RUNS / time.strftime("%Y%m%d-%H%M%S")
    rows: dict[str, list[Row]] = {}
    meta: dict[str, dict] = {}
    for name in names:
        section = SECTIONS[name]
        print(f"\n== {name}: {section.title}", flush=True)
        rounds = args.rounds or (QUICK_ROUNDS.get(name, 1) if args.quick else None)
        ctx = BenchContext(run_dir=run_root / name, rounds=rounds, quick=args.quick, cases=tuple(args.case or ()))
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        t0, load_before = time.perf_counter(), os.getloadavg()[0]
        try:
            rows[name] = section.run(ctx)
        except (BenchError, ApiError) as e:
            print(f"error: section {name}: {e}", file=sys.stderr)
            return 1
        meta[name] = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": round(time.perf_counter() - t0, 1),
                      "quick": args.quick, "rounds": rounds,
                      "load": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # 1-minute, before and after
                      "machine": machine, "scratch": str(ctx.run_dir.relative_to(BENCH.parent))}
    save(out, merge(load(out), rows, meta, machine, order=list(SECTIONS), partial=bool(args.case)))
    print(f"\n{markdown_table([r for name in names for r in rows[name]])}")
    print(f"\nrows written to {out}; total wall time {time.perf_counter() - start:.0f} s")
    if out == RESULTS:
        print("BENCHMARKS.md's tables: `python -m bench.report` rewrites them from these rows (CI checks they agree)")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=list(SECTIONS),
                   help="run only this section (repeatable); other sections' rows in the results file are kept")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds per section (default: its own)")
    p.add_argument("--case", action="append", default=None,
                   help="run only this case of the sections that have cases (repeatable: tinker: service, tenants; "
                        "savers_grads: powersgd, compile; savers-optim: its variants); only the rows measured replace "
                        "their namesakes")
    p.add_argument("--quick", action="store_true",
                   help=f"a pass under 5 minutes: sections {', '.join(QUICK_SECTIONS)} (unless --only), one or two "
                        "rounds, fewer steps; results to bench/results-quick.json (unless --out)")
    p.add_argument("--out", type=Path, default=None,
                   help="results file (default bench/results.json; with --quick, bench/results-quick.json)")
    return p


if __name__ == "__main__":
    sys.exit(main())
