"""A rank's step report and a step's metrics row as the coordinator reads them (`StepReport`, `StepRow`), built
in-test with plausible figures and any field given."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from trainyard.actors.telemetry import StepRow
from trainyard.parallel.runtime.step.step_stats import StepReport, StepStats

STATS = {"step": 0, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "compute_s": 0.2, "pp_rank": 0, "dp_rank": 0,
         "tp_rank": 0, "forward_s": 0.1, "backward_s": 0.2, "comm_s": 0.0, "schedule_s": 0.4, "peak_activations": 2,
         "peak_activation_bytes": 2**20, "optimizer_bytes": 0, "optimizer_host_bytes": 0, "early_reductions": 0,
         "buckets": 0, "reduce_bytes": 0, "compile_s": 0.0, "moe": {}}


def step_report(**given: Any) -> StepReport:
    """A rank's report of a step it ran: `given` StepStats fields and report fields over the defaults."""
    own = {f.name for f in fields(StepStats)}
    stats = StepStats(**{**STATS, **{k: v for k, v in given.items() if k in own}})
    extra = {k: v for k, v in given.items() if k not in own}
    return StepReport(step=stats.step, dp_rank=stats.dp_rank, stats=stats, **extra)


def step_row(step: int, **given: Any) -> StepRow:
    """A step's metrics row of one rank's step: `given` fields over plausible figures."""
    row = {"step": step, "loss": 5.0 - step * 1e-4, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e4,
           "step_time_s": 0.01, "coordinator_overhead_s": 0.001, "bubble_fraction": 0.0, "stage_forward_s": [0.003],
           "stage_backward_s": [0.006], "stage_peak_activations": [1], "stage_peak_activation_mb": [0.1],
           "reduce_bytes": 0, "cross_replica_bytes": 0}
    return StepRow(**{**row, **given})
