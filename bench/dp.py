"""Section "dp": a trainyard dp=2 job through the real service against torchrun + DDP, side by side.

Both sides train the JobSpec in bench/dp2.yaml (same GPT, init, samples, optimizer, steps) on this machine:
- trainyard: one `trainyard serve` for the section, warmed up with a short discarded job, then one job
  per round submitted over REST; per-step `step_time_s` (the coordinator's wall time) and
  `coordinator_overhead_s` come from GET /api/jobs/{id}/metrics;
- ddp: bench/ddp_baseline.py under torchrun, 2 gloo processes with OMP_NUM_THREADS=1, DDP's overlapped
  all-reduce (the baseline of the ratio);
- after-backward: the same script without DDP, all-reducing once after backward with trainyard's own
  `parallel.runtime.dp.data_parallel` (a diagnostic: trainyard's math without Ray, and DDP's overlap switched off);
- no-ray: the job's plan on trainyard's own ranks (`RankDriver`, the class the service's Worker actors wrap) as local
  processes (`parallel.runtime.local_world`), without Ray, the service or the coordinator; a step is the slower
  rank's `compute_s`. Beside the service's step it measures what running under Ray costs on this machine.
The baselines run while the service idles. Each round runs the four in turn, and short rounds repeat, so slow
drift of the machine (on a shared host, other tenants' load) hits every side alike. A run's figure is the median
of its measured steps (the first WARMUP_STEPS of every run are skipped); the step rows give each side's median of
its rounds' figures (issue 48's measure: "median of its rounds"), the median over every measured step pooled in
the note; the breakdown's parts are pooled medians. Before each round, with only the idle service running, the
share of the machine that is busy is read from /proc/stat and logged: a high value means noisy timings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from trainyard.cli.offline import read_spec_file
from trainyard.parallel.config import JobConfig
from trainyard.parallel.spec import parse_spec

from bench.context import BENCH, REPO, BenchContext
from bench.machine import busy_fraction
from bench.results import Row, at_most, median, ratio
from bench.service_job import BenchError, TrainyardService

SPEC_PATH = BENCH / "dp2.yaml"
BASELINE_SCRIPT = BENCH / "ddp_baseline.py"
ROUNDS = 6
WARMUP_JOB_STEPS = 5
BUSY_WARNING = 0.15  # machine busy before a round (idle service included) above which timings are suspect
WARMUP_STEPS = 5
LOSS_RTOL = 1e-4  # the project's layout-equivalence tolerance (fp32)
TARGET_RATIO = 1.00  # issue 48: "dp=2 at most 1.00x torchrun + DDP (median of its rounds, same run)"
BASELINE_TIMEOUT_S = 180  # a run takes about 10 s; one once hung in gloo's teardown after writing every step

Steps = list[dict[str, Any]]  # one record per step, as the side reported it (API metrics rows or baseline JSON)


class Side(StrEnum):
    """The runs of a round, in the order they run (trainyard first: a broken service fails fast)."""

    TRAINYARD = "trainyard"
    DDP = "ddp"
    AFTER_BACKWARD = "after-backward"
    NO_RAY = "no-ray"


@dataclass(frozen=True)
class Parts:
    """One step's wall time and its parts, in seconds (None: that side does not measure the part)."""

    step: float
    forward: float | None = None
    """Reading the batch and the forward pass."""
    backward: float | None = None
    """Backward; with DDP it includes waiting for the all-reduce it overlaps with backward."""
    after_backward: float | None = None
    """Gradient all-reduce (not with DDP), clipping, AdamW step, loss all-reduce."""
    overhead: float | None = None
    """trainyard only: the coordinator's step wall time minus the slowest worker's compute."""

    @classmethod
    def of_trainyard(cls, row: dict[str, Any]) -> Parts:
        step, overhead = row["step_time_s"], row["coordinator_overhead_s"]
        if "stage_forward_s" not in row:  # a coordinator that does not report per-stage timings
            return cls(step=step, overhead=overhead)
        forward, backward = row["stage_forward_s"][0], row["stage_backward_s"][0]
        # step - overhead is the slowest rank's compute; forward/backward are rank dp0's.
        return cls(step=step, forward=forward, backward=backward, after_backward=step - overhead - forward - backward,
                   overhead=overhead)

    @classmethod
    def of_no_ray(cls, record: dict[str, Any]) -> Parts:
        step, forward, backward = record["step_time_s"], record["forward_s"], record["backward_s"]
        return cls(step=step, forward=forward, backward=backward, after_backward=step - forward - backward)

    @classmethod
    def of_baseline(cls, record: dict[str, Any]) -> Parts:
        return cls(step=record["step_time_s"], forward=record["forward_s"], backward=record["backward_s"],
                   after_backward=record["grad_sync_s"] + record["update_s"])

    @classmethod
    def median_of(cls, parts: list[Parts]) -> Parts:
        """The median of each part separately (so the medians need not add up to the median step)."""
        def med(name: str) -> float | None:
            values = [getattr(p, name) for p in parts]
            return None if any(v is None for v in values) else median(values)

        return cls(**{f.name: med(f.name) for f in fields(cls)})


PART_TITLES = {
    "forward": "forward (incl. reading the batch)",
    "backward": "backward (DDP: incl. its overlapped all-reduce)",
    "after_backward": "after backward: grad all-reduce (not DDP), clip, AdamW, loss all-reduce",
    "overhead": "coordinator overhead (Ray calls)",
    "step": "step",
}
COLUMN_TITLES = {
    Side.TRAINYARD: "trainyard",
    Side.AFTER_BACKWARD: "torchrun, all-reduce after backward",
    Side.DDP: "torchrun DDP",
    Side.NO_RAY: "trainyard's ranks, no Ray",
}


def run_section(ctx: BenchContext) -> list[Row]:
    spec = read_spec_file(str(SPEC_PATH))
    cfg = parse_spec(spec)
    rounds = ctx.rounds or ROUNDS
    ctx.log(f"dp: {SPEC_PATH.relative_to(REPO)}: {cfg.model.n_layer} layers, d_model {cfg.model.d_model}, "
            f"seq_len {cfg.model.seq_len}, global_batch {cfg.global_batch}, dp={cfg.parallel.dp}, "
            f"{cfg.steps} steps; {rounds} rounds of {', '.join(Side)}")
    runs: dict[Side, list[Steps]] = {side: [] for side in Side}
    busy: list[float] = []
    with TrainyardService(ctx.run_dir / "service") as service:  # its state dir, with serve.log
        ctx.log(f"trainyard serve is up on port {service.port}; warm-up job of {WARMUP_JOB_STEPS} steps")
        service.run_job({**spec, "name": "bench-warm-up", "steps": WARMUP_JOB_STEPS})
        for r in range(1, rounds + 1):
            busy.append(_log_busy(ctx, r, rounds))
            for side in Side:
                prefix = ctx.run_dir / f"{side}-r{r}"
                steps = (service.run_job(spec) if side is Side.TRAINYARD else _run_no_ray(spec)
                         if side is Side.NO_RAY else _run_baseline(side, prefix, cfg))
                runs[side].append(steps)
                ctx.log(f"round {r}/{rounds} {side:<15} median step {_run_median(steps):.4f} s")
    (ctx.run_dir / "steps.json").write_text(json.dumps(runs))
    medians = {side: Parts.median_of([_parts(side, s) for steps in side_runs for s in _measured(steps)])
               for side, side_runs in runs.items()}
    print(_breakdown_table(medians), flush=True)
    return _rows(runs, medians, busy)


def _log_busy(ctx: BenchContext, round_no: int, rounds: int) -> float:
    value = busy_fraction() or 0.0
    warning = " - others are using the machine, timings will be noisy" if value > BUSY_WARNING else ""
    ctx.log(f"round {round_no}/{rounds}: machine {100 * value:.0f}% busy before it{warning}")
    return value


def _run_baseline(grad_sync: str, prefix: Path, cfg: JobConfig) -> Steps:
    """bench/ddp_baseline.py under torchrun (dp processes); rank 0's per-step records. Logs go to `<prefix>.log`."""
    out, log_path = prefix.with_suffix(".json"), prefix.with_suffix(".log")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cfg.parallel.dp),
           str(BASELINE_SCRIPT), "--spec", str(SPEC_PATH), "--out", str(out), "--grad-sync", grad_sync]
    with log_path.open("wb") as log:
        # A session of its own: on a timeout, torchrun and the ranks it started are killed together.
        process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | str = process.wait(timeout=BASELINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = f"nothing (killed after {BASELINE_TIMEOUT_S} s)"
    steps = json.loads(out.read_text())["steps"] if out.exists() else []
    if len(steps) == cfg.steps and code != 0:
        # Rank 0 writes the file only after the last step: the run measured everything and failed on exit.
        print(f"warning: torchrun --grad-sync {grad_sync} exited {code} after writing all "
              f"{cfg.steps} steps (a crash or hang while shutting down); using them. See {log_path}", flush=True)
    elif len(steps) != cfg.steps or code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise BenchError(f"torchrun {BASELINE_SCRIPT.name} --grad-sync {grad_sync} exited {code}; "
                         f"{log_path}:\n{tail}")
    return steps


def _run_no_ray(spec: dict[str, Any]) -> Steps:
    """The job's plan on trainyard's ranks as local processes (no Ray): one record per step, as the baseline's,
    its time the slower rank's compute and its forward and backward rank dp0's."""
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.runtime.local_world import PlanRun, run_plan

    ranks = [result.stats for result in run_plan(PlanRun(make_plan(parse_spec(spec))))]
    return [{"step": per_rank[0]["step"], "step_time_s": max(s["compute_s"] for s in per_rank),
             "forward_s": per_rank[0]["forward_s"], "backward_s": per_rank[0]["backward_s"],
             "loss": per_rank[0]["loss"]} for per_rank in zip(*ranks, strict=True)]


def _measured(steps: Steps) -> Steps:
    return [s for s in steps if s["step"] >= WARMUP_STEPS]


def _parts(side: Side, record: dict[str, Any]) -> Parts:
    if side is Side.TRAINYARD:
        return Parts.of_trainyard(record)
    return Parts.of_no_ray(record) if side is Side.NO_RAY else Parts.of_baseline(record)


def _run_median(steps: Steps) -> float:
    return median(s["step_time_s"] for s in _measured(steps))


def _percentages(values: list[float]) -> str:
    return "/".join(f"{100 * v:.0f}%" for v in values)


def _median_of_rounds(runs: list[Steps]) -> float:
    return median(_run_median(steps) for steps in runs)


def _per_run(runs: list[Steps]) -> str:
    return "/".join(f"{_run_median(steps):.3f}" for steps in runs)


def _loss_note(runs: dict[Side, list[Steps]]) -> str:
    """Whether every run computed the same losses as the first DDP run (the sides must do the same math)."""
    ref = {s["step"]: s["loss"] for s in runs[Side.DDP][0]}
    diff = max(abs(s["loss"] - ref[s["step"]]) / abs(ref[s["step"]])
               for side_runs in runs.values() for steps in side_runs for s in steps)
    if diff <= LOSS_RTOL:
        return f"losses equal DDP's within {diff:.1e} rel."
    return f"LOSSES DIFFER from DDP's by {diff:.1e} rel. (> {LOSS_RTOL:g})"


def _rows(runs: dict[Side, list[Steps]], medians: dict[Side, Parts], busy: list[float]) -> list[Row]:
    ours, ddp, post = medians[Side.TRAINYARD], medians[Side.DDP], medians[Side.AFTER_BACKWARD]
    ours_rounds, ddp_rounds = _median_of_rounds(runs[Side.TRAINYARD]), _median_of_rounds(runs[Side.DDP])
    no_ray_rounds = _median_of_rounds(runs[Side.NO_RAY])
    counts = "/".join(str(sum(len(_measured(s)) for s in runs[side])) for side in (Side.TRAINYARD, Side.DDP))
    rows = [
        Row("dp2 step time (median of rounds, s)", ours_rounds, ddp_rounds, ratio(ours_rounds, ddp_rounds), "s",
            f"vs torchrun+DDP; each side's median of its {len(runs[Side.DDP])} rounds' median steps; per-run medians "
            f"ours {_per_run(runs[Side.TRAINYARD])}, DDP {_per_run(runs[Side.DDP])}; pooled over all {counts} "
            f"steps: ours {ours.step:.4f}, DDP {ddp.step:.4f} ({ratio(ours.step, ddp.step):.3f}x); "
            f"{_loss_note(runs)}; machine busy before rounds {_percentages(busy)}",
            target=at_most(TARGET_RATIO, of="ratio")),
        Row("dp2 step time, trainyard's ranks without Ray (median of rounds, s)", no_ray_rounds, ddp_rounds,
            ratio(no_ray_rounds, ddp_rounds), "s", "the same plan on RankDriver as local processes (no Ray, no "
            f"service), the slower rank's compute per step, vs torchrun+DDP; per-run medians "
            f"{_per_run(runs[Side.NO_RAY])}"),
        Row("dp2 step under Ray and the service vs the same ranks without (median of rounds)", ours_rounds,
            no_ray_rounds, ratio(ours_rounds, no_ray_rounds), "s", "what the Worker actors, the coordinator's calls "
            "and Ray's and the service's own processes cost the ranks on this machine (every core busy)"),
        Row("dp2 coordinator overhead per step (median s)", ours.overhead, None, ratio(ours.overhead, ours.step), "s",
            "step wall time minus the slowest worker's in-step compute; ratio = overhead / our step time"),
        Row("dp2 step time vs torchrun + post-backward all-reduce (median s)", ours.step, post.step,
            ratio(ours.step, post.step), "s", "baseline: the DDP script without DDP, trainyard's own grad sync, "
            f"no Ray; per-run medians {_per_run(runs[Side.AFTER_BACKWARD])}"),
    ]
    if ours.forward is None:
        return rows
    return rows + [
        Row("dp2 forward incl. batch read (median s)", ours.forward, ddp.forward, ratio(ours.forward, ddp.forward),
            "s", "ours: rank dp0"),
        Row("dp2 backward (median s)", ours.backward, ddp.backward, ratio(ours.backward, ddp.backward), "s",
            "ours: rank dp0, backward only; DDP: backward with its overlapped gradient all-reduce"),
        Row("dp2 after backward (median s)", ours.after_backward, ddp.after_backward,
            ratio(ours.after_backward, ddp.after_backward), "s", "ours: grad all-reduce + clip + AdamW + loss "
            "all-reduce (slowest rank's compute - dp0's fwd/bwd); DDP: clip + AdamW + loss all-reduce"),
    ]


def _breakdown_table(medians: dict[Side, Parts]) -> str:
    def cell(side: Side, part: str) -> str:
        value = getattr(medians[side], part)
        return "-" if value is None else f"{value:.4f}"

    columns = (Side.TRAINYARD, Side.NO_RAY, Side.AFTER_BACKWARD, Side.DDP)
    lines = ["where the time goes (median s per step; medians of parts do not add up exactly):",
             "| part | " + " | ".join(COLUMN_TITLES[side] for side in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    lines += [f"| {title} | " + " | ".join(cell(side, part) for side in columns) + " |"
              for part, title in PART_TITLES.items()]
    return "\n".join(lines)
