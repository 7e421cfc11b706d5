"""A job's metrics: one row per finished step (kept in memory, appended to the metrics log, served to the
service's polls) and the Ray gauges the dashboard shows.

A poll asks for the rows of steps >= `since`; the rows are in step order, so that is a binary search and a
slice: the work of a poll does not grow with the job's length.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ray.util.metrics import Gauge
from trainyard.actors.journal import METRICS_LOG, AppendOnly
from trainyard.actors.tracking import Trackers

if TYPE_CHECKING:
    from trainyard.parallel.plan import Plan

log = logging.getLogger("trainyard.coordinator")

_GAUGES = {
    "step": Gauge("trainyard_step", "Last finished step", tag_keys=("job_id",)),
    "loss": Gauge("trainyard_loss", "Training loss of the last step", tag_keys=("job_id",)),
    "tokens_per_s": Gauge("trainyard_tokens_per_s", "Training throughput", tag_keys=("job_id",)),
    "step_time_s": Gauge("trainyard_step_time_s", "Wall time of the last step", tag_keys=("job_id",)),
    "bubble_fraction": Gauge("trainyard_bubble_fraction", "Measured pipeline bubble of the last step",
                             tag_keys=("job_id",)),
}
_STAGE_GAUGES = {
    "stage_forward_s": Gauge("trainyard_stage_forward_s", "Forward time of a pipeline stage in the last step",
                             tag_keys=("job_id", "stage")),
    "stage_backward_s": Gauge("trainyard_stage_backward_s", "Backward time of a pipeline stage in the last step",
                              tag_keys=("job_id", "stage")),
}
_MOE_GAUGES = {
    "aux_loss": Gauge("trainyard_moe_aux_loss", "Load-balancing loss of an MoE layer in the last step (1: balanced)",
                      tag_keys=("job_id", "layer")),
    "z_loss": Gauge("trainyard_moe_z_loss", "Router z-loss of an MoE layer in the last step",
                    tag_keys=("job_id", "layer")),
    "dropped_fraction": Gauge("trainyard_moe_dropped_fraction",
                              "Fraction of an MoE layer's token assignments over capacity in the last step",
                              tag_keys=("job_id", "layer")),
}
_EXPERT_LOAD = Gauge("trainyard_moe_expert_load", "Tokens routed to an expert of an MoE layer in the last step",
                     tag_keys=("job_id", "layer", "expert"))


class Rows:
    """The metrics rows of the job, one per step, in step order, and where they are logged."""

    def __init__(self, root: Path, rows: list[dict], trackers: Trackers | None = None):
        self.root, self.rows, self.trackers = root, rows, trackers
        self.log = AppendOnly(root / METRICS_LOG)

    def since(self, step: int) -> list[dict]:
        return self.rows[bisect_left(self.rows, step, key=lambda r: r["step"]):]

    def trim(self, step: int) -> None:
        """Forget the rows of steps >= `step` (they are run again from a checkpoint before it)."""
        del self.rows[bisect_left(self.rows, step, key=lambda r: r["step"]):]

    def next_step(self, default: int) -> int:
        return self.rows[-1]["step"] + 1 if self.rows else default

    def recent_step_times(self, window: int) -> list[float]:
        return [row["step_time_s"] for row in self.rows[-window:]]

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.log.append(row)
        if self.trackers is not None:  # after the log: a row a tracker has is one the job has
            self.trackers.add(row)


def figures_by_step(plan: Plan, answers: Iterable[object], first: int) -> dict[int, tuple[dict, ...]]:
    """The ranks' figures of steps `first` on, in the answers of calls to them (a step's call answers each rank's list
    of the StepStats dicts it read, `RankDriver.queue_step`; any other answer is skipped), by step, one per rank in
    rank order (a rank's latest where several answers hold its figures). Sat-out answers (no coordinates) are left
    out."""
    by_step: dict[int, dict[int, dict]] = {}
    for answer in answers:
        for r in answer if isinstance(answer, list) else ():
            if isinstance(r, dict) and "pp_rank" in r and r.get("step", -1) >= first:
                by_step.setdefault(r["step"], {})[plan.rank_of(r["pp_rank"], r["tp_rank"], r["dp_rank"])] = r
    return {step: tuple(rows[rank] for rank in sorted(rows)) for step, rows in by_step.items()}


def make_row(step: int, results: list[dict], elapsed: float, tokens: int,
             predicted_step_s: float | None = None) -> dict:
    """One step's row from every rank's results; `predicted_step_s`: the planner's prediction of the step time
    (`parallel: auto`), carried beside the measured `step_time_s` so a wrong cost model shows. The answers of
    a replica that sat the step out or only rejoined at its sync (`RankDriver.step`) are left out; the loss is
    the mean over the replicas' when they differ (local_sgd, diloco with a replica dropped: each has its own)."""
    sent = max(r.get("cross_replica_bytes", 0) for r in results)
    results = [r for r in results if not (r.get("sat_out") or r.get("rejoined"))]
    last = next(r for r in results if r["loss"] is not None)
    losses = list({r["dp_rank"]: r["loss"] for r in results if r["loss"] is not None}.values())
    row = {
        "step": step,
        "loss": last["loss"] if len(set(losses)) == 1 else sum(losses) / len(losses),
        "lr": last["lr"],
        "grad_norm": last["grad_norm"],
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed,
        # Wall time between two steps' results that no rank spent computing.
        "coordinator_overhead_s": max(0.0, elapsed - max(r["compute_s"] for r in results)),
        **pipeline_metrics(results),
        # Gradient bytes the busiest rank handed to the step's data-parallel reductions (PowerSGD's, compressed).
        "reduce_bytes": max(r["reduce_bytes"] for r in results),
        # The most any rank all-reduced across the data-parallel replicas (parallel.sync).
        "cross_replica_bytes": sent,
    }
    rss = [r["peak_rss_bytes"] for r in results if "peak_rss_bytes" in r]
    if rss:
        row["peak_rss_bytes"] = max(rss)  # the largest rank process's resident high-water mark so far (the OS's)
    compiled = max(r["compile_s"] for r in results)
    if compiled > 0:
        row["compile_s"] = compiled  # the slowest rank's torch.compile time in this step (`compile: true`)
    if predicted_step_s is not None:
        row["predicted_step_s"] = predicted_step_s
    moe = moe_metrics(results)
    if moe:
        row["moe"] = moe
    examples = sorted((r for r in results if "sample_ids" in r and r["pp_rank"] == 0 and r["tp_rank"] == 0),
                      key=lambda r: r["dp_rank"])
    if examples:  # whole examples (`data.packing`): the global batch's sample ids, and the epochs done
        row["sample_ids"] = [i for r in examples for i in r["sample_ids"]]
        row["epoch"] = examples[0]["epoch"]
    val = [r["val_loss"] for r in results if r.get("val_loss") is not None]
    if val:
        row["val_loss"] = val[0]
    blocked = [r["checkpoint_blocked_s"] for r in results if "checkpoint_blocked_s" in r]
    if blocked:
        row["checkpoint_blocked_s"] = max(blocked)  # the step waited for its slowest rank's save
    failed = [r["checkpoint_error"] for r in results if "checkpoint_error" in r]
    if failed:
        row["checkpoint_error"] = failed[0]  # every rank of a save says so alike
    return row


def checkpoint_event(row: dict) -> dict | None:
    """The event of the checkpoint the step wrote after it, if it wrote one."""
    if "checkpoint_blocked_s" not in row:
        return None
    return {"time": time.time(), "kind": "checkpoint", "step": row["step"] + 1,
            "blocked_s": row["checkpoint_blocked_s"]}


def compile_event(row: dict) -> dict | None:
    """The event of the blocks compiled during the step (`compile: true`: the first step, and any recompile)."""
    if "compile_s" not in row:
        return None
    return {"time": time.time(), "kind": "compile", "step": row["step"], "compile_s": row["compile_s"]}


def set_gauges(job_id: str, row: dict, steps: int) -> None:
    step = row["step"]
    for key, gauge in _GAUGES.items():
        gauge.set(row[key] if key != "step" else step + 1, tags={"job_id": job_id})
    for key, gauge in _STAGE_GAUGES.items():
        for stage, value in enumerate(row[key]):
            gauge.set(value, tags={"job_id": job_id, "stage": str(stage)})
    for layer, values in row.get("moe", {}).items():
        tags = {"job_id": job_id, "layer": layer}
        for key, gauge in _MOE_GAUGES.items():
            gauge.set(values[key], tags=tags)
        for expert, load in enumerate(values["load"]):
            _EXPERT_LOAD.set(load, tags={**tags, "expert": str(expert)})
    if step == 0 or (step + 1) % 10 == 0:
        log.info("job %s step %d/%d loss %.4f", job_id, step + 1, steps, row["loss"])


def pipeline_metrics(results: list[dict]) -> dict:
    """Per-stage timings of the first pipeline (tensor-parallel rank 0 of the lowest data-parallel replica with
    every stage among the results: after a failure, any whole one), and its measured bubble fraction.

    bubble = 1 - (time the stages spent computing) / (pp x the longest stage's schedule wall time).
    """
    stages = sorted(_first_pipeline(results), key=lambda r: r["pp_rank"])
    busy = sum(r["forward_s"] + r["backward_s"] for r in stages)
    span = max(r["schedule_s"] for r in stages)
    return {
        "bubble_fraction": max(0.0, 1.0 - busy / (len(stages) * span)) if span > 0 else 0.0,
        "stage_forward_s": [r["forward_s"] for r in stages],
        "stage_backward_s": [r["backward_s"] for r in stages],
        "stage_peak_activations": [r["peak_activations"] for r in stages],
        "stage_peak_activation_mb": [r["peak_activation_bytes"] / 2**20 for r in stages],
    }


def _first_pipeline(results: list[dict]) -> list[dict]:
    """The tensor-parallel rank 0 of every stage of the lowest data-parallel replica whose stages all answered."""
    from trainyard.actors.failure_handling.replicas import complete_pipeline

    pp = 1 + max(r["pp_rank"] for r in results)
    d = complete_pipeline(results, pp)
    return [r for r in results if r["dp_rank"] == d and r["tp_rank"] == 0]


def moe_metrics(results: list[dict]) -> dict[str, dict]:
    """Each MoE layer's statistics, keyed by its block index; every rank of a stage holds the stage's sums, so
    one pipeline's ranks have them all."""
    stages = _first_pipeline(results)
    layers = {layer: values for r in stages for layer, values in r["moe"].items()}
    return dict(sorted(layers.items(), key=lambda item: int(item[0])))
