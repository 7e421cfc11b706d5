"""Section "savers-optim": the low-memory optimizers and offload, each against its off state, side by side.

Run: `python -m bench.run --only savers-optim` (a few minutes on 2 cores); torch alone, in this process.
`--case NAME` (repeatable) trains only those variants beside adamw, the reference (e.g. `--case adafactor`).

The demo job (examples/demo.yaml: GPT 4 layers, d_model 128, seq_len 64, global_batch 16, 400 steps on
examples/corpus.txt) at one rank, one trainer per variant on the same process group (`RankDriver.trainer_for`),
trained side by side: each round is one step of every variant, in an order rotating from round to round, so
the machine's drift hits all alike; a time ratio is the median of the per-round ratios.

- `adamw8bit` vs `adamw`: optimizer-state bytes (measured, `StepStats.optimizer_bytes`), step time, and the
  mean loss of the last LAST steps (the issue's claim: within 2%).
- `adafactor` vs `adamw`: the same (claim: within 5%). `parallel.optim.adafactor` (HF's settings without a relative
  step: the lr under the job's schedule, times each tensor's RMS; no first moment, update clipping 1,
  decoupled weight decay) at ADAFACTOR: the job's weight decay, and the lr BENCHMARKS.md's sweep chose.
  `python -m bench.savers_optim LR,LR,...` trains adafactor at those lrs side by side (no adamw) and prints
  each one's end loss: how that sweep was measured.
- `offload` vs `adamw`: device optimizer bytes (0) and host bytes, step time; losses equal.
- `act-offload` vs `adamw`: peak saved-activation bytes on the device (the pipeline's meter), step time;
  losses equal.
On this CPU-only machine "host" and "device" are the same memory: the rows show what the device would no
longer hold, and what the extra copies cost; BENCHMARKS.md says what a GPU measured.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import yaml
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.spec import parse_spec

from bench.context import REPO, BenchContext
from bench.perf import rotated
from bench.results import Row, at_most, ratio
from bench.service_job import BenchError, free_port

LAST = 20
ADAFACTOR = {"kind": "adafactor", "lr": 0.07}
VARIANTS: dict[str, dict[str, Any]] = {
    "adamw": {},
    "adamw8bit": {"optimizer": {"kind": "adamw8bit"}},
    "adafactor": {"optimizer": ADAFACTOR},
    "offload": {"optimizer": {"offload": True}},
    "act-offload": {"activation_offload": True},
}
EQUAL_RTOL = 1e-6
CLAIMS = {"adamw8bit": 0.02, "adafactor": 0.05}
MB = 2**20


def demo_spec(steps: int | None) -> dict[str, Any]:
    spec = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    spec["data"]["path"] = str(REPO / spec["data"]["path"])
    spec["parallel"] = {"dp": 1}
    spec["resources"] = {"gpus_per_worker": 0}
    if steps is not None:
        spec["steps"] = steps
    return spec


def variant_plan(name: str, steps: int | None) -> Plan:
    spec = demo_spec(steps)
    for key, value in VARIANTS[name].items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    return make_plan(parse_spec(spec))


def train_side_by_side(steps: int | None, names: tuple[str, ...] = (), reference: bool = True
                       ) -> dict[str, list[dict]]:
    """Every variant (or adamw, unless not `reference`, and `names`) trained side by side: per round one step
    of each."""
    keep = (*names, *(["adamw"] if reference else []))
    plans = {name: variant_plan(name, steps) for name in VARIANTS if not names or name in keep}
    torch.set_num_threads(1)
    driver = RankDriver(next(iter(plans.values())), 0, "127.0.0.1", free_port(), torch.device("cpu"), timeout_s=300)
    try:
        trainers = {name: driver.trainer_for(plan) for name, plan in plans.items()}
        stats: dict[str, list[dict]] = {name: [] for name in plans}
        for step in range(driver.plan.config.steps):
            share = driver.microbatches(step)
            for name in rotated(list(plans), step):
                stats[name].append(trainers[name].train_step(step, share).to_dict())
        return stats
    finally:
        driver.close()


def run_section(ctx: BenchContext) -> list[Row]:
    steps = 60 if ctx.quick else None
    start = time.perf_counter()
    names = [n for n in VARIANTS if not ctx.cases or n in ("adamw", *ctx.cases)]
    ctx.log(f"savers-optim: the demo job at one rank, variants {', '.join(names)} side by side"
            f"{' (quick: 60 steps)' if steps else ''}")
    unknown = set(ctx.cases) - set(VARIANTS)
    if unknown:
        raise BenchError(f"savers-optim: no variant {sorted(unknown)}; known: {list(VARIANTS)}")
    stats = train_side_by_side(steps, ctx.cases)
    n = len(stats["adamw"])
    ctx.log(f"trained {n} steps of each in {time.perf_counter() - start:.0f} s")
    losses = {name: [s["loss"] for s in rows] for name, rows in stats.items()}
    for name in [n for n in ("offload", "act-offload") if n in stats]:
        worst = max(abs(a - b) / b for a, b in zip(losses[name], losses["adamw"], strict=True))
        if worst > EQUAL_RTOL:
            raise BenchError(f"savers-optim: {name}'s losses differ from adamw's by {worst:.1e} relative")
    final = {name: statistics.mean(v[-LAST:]) for name, v in losses.items()}
    times = {name: [s["compute_s"] for s in rows[1:]] for name, rows in stats.items()}

    def time_ratio(name: str) -> float:
        return statistics.median(t / b for t, b in zip(times[name], times["adamw"], strict=True))

    def step_ms(name: str) -> float:
        return 1e3 * statistics.median(times[name])

    base_bytes = stats["adamw"][-1]["optimizer_bytes"]
    rows = []
    for name, claim in [(n, c) for n, c in CLAIMS.items() if n in stats]:
        mine = stats[name][-1]["optimizer_bytes"]
        gap = final[name] / final["adamw"] - 1
        ctx.log(f"{name}: state {mine / MB:.3f} MB vs {base_bytes / MB:.3f} MB; last-{LAST} mean loss "
                f"{final[name]:.4f} vs {final['adamw']:.4f} ({100 * gap:+.2f}%, claim within {100 * claim:.0f}%)")
        rows += [
            Row(f"{name} vs adamw: optimizer state (MB)", mine / MB, base_bytes / MB, ratio(mine, base_bytes), "MB",
                "measured on the rank (StepStats.optimizer_bytes); torchao keeps tensors under 4096 elements in "
                "fp32" if name == "adamw8bit" else "measured on the rank: row and column factors, full vectors"),
            Row(f"{name} vs adamw: step time (median ms)", step_ms(name), step_ms("adamw"), time_ratio(name), "ms",
                "ratio: median of the per-step ratios, side by side"),
            Row(f"{name} vs adamw: mean loss of the last {LAST} of {n} steps", final[name], final["adamw"],
                final[name] / final["adamw"], "loss",
                f"{100 * gap:+.2f}%" + (f"; Adafactor at {ADAFACTOR}" if name == "adafactor" else ""),
                target=at_most(1 + claim, of="ratio")),  # the claim is one-sided: lower than adamw meets it
        ]
    for row in rows:
        ctx.log(f"{row.name}: {row.ours:.4g} vs {row.baseline:.4g}")
    if "offload" in stats:
        rows += _offload_rows(stats, base_bytes, step_ms, time_ratio)
    if "act-offload" in stats:
        rows += _activation_rows(stats, step_ms, time_ratio)
    return rows


def _offload_rows(stats, base_bytes, step_ms, time_ratio) -> list[Row]:
    off = stats["offload"][-1]
    return [
        Row("optimizer.offload vs off: optimizer state on the device (MB)", off["optimizer_bytes"] / MB,
            base_bytes / MB, ratio(off["optimizer_bytes"], base_bytes), "MB",
            f"host then holds {off['optimizer_host_bytes'] / MB:.3f} MB (state + host copies of parameters and "
            f"gradients); losses equal within {EQUAL_RTOL:g}"),
        Row("optimizer.offload vs off: step time (median ms)", step_ms("offload"), step_ms("adamw"),
            time_ratio("offload"), "ms", "CPU only: the copies are host-to-host"),
    ]


def _activation_rows(stats, step_ms, time_ratio) -> list[Row]:
    act, base_act = stats["act-offload"][-1]["peak_activation_bytes"], stats["adamw"][-1]["peak_activation_bytes"]
    return [
        Row("activation_offload vs off: peak saved activations on the device (MB)", act / MB, base_act / MB,
            ratio(act, base_act), "MB",
            f"the blocks' saved tensors go to the host; losses equal within {EQUAL_RTOL:g}"),
        Row("activation_offload vs off: step time (median ms)", step_ms("act-offload"), step_ms("adamw"),
            time_ratio("act-offload"), "ms", "CPU only: save_on_cpu copies host-to-host"),
    ]


def sweep(lrs: list[float]) -> None:
    """Adafactor at each lr, side by side on the demo job, without the reference: each one's end loss."""
    VARIANTS.update({f"adafactor-{lr:g}": {"optimizer": {**ADAFACTOR, "lr": lr}} for lr in lrs})
    stats = train_side_by_side(None, tuple(f"adafactor-{lr:g}" for lr in lrs), reference=False)
    for name, rows in stats.items():
        print(f"{name}: mean loss of the last {LAST} steps {statistics.mean(s['loss'] for s in rows[-LAST:]):.4f}")


if __name__ == "__main__":  # python -m bench.savers_optim 0.03,0.1,0.3
    import sys

    sweep([float(x) for x in sys.argv[1].split(",")])
