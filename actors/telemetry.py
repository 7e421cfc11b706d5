"""A job's metrics: one row per finished step (kept in memory, appended to the metrics log, served to the
service's polls) and the Ray gauges the dashboard shows.

A row is made from the ranks' `StepReport`s (`make_row`) as a `StepRow`, read by attribute in the coordinator; what
leaves it (the metrics log, the trackers, the service's polls) is `StepRow.to_row()`, the dict the rows always were,
key for key and in the same order (`Rows.add` is that boundary; the rows read back from the log stay dicts).

A poll asks for the rows of steps >= `since`; the rows are in step order, so that is a binary search and a
slice: the work of a poll does not grow with the job's length.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import cast

from ray.util.metrics import Gauge
from trainyard.actors.failure_handling.replicas import complete_pipeline
from trainyard.actors.journal import METRICS_LOG, AppendOnly
from trainyard.actors.tracking import Trackers
from trainyard.parallel.plan import Plan
from trainyard.parallel.runtime.step.step_row import MoELayerRow, StepRow
from trainyard.parallel.runtime.step.step_stats import StepReport, StepStats

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

    def largest_peak_rss(self) -> int | None:
        """The largest resident peak a row holds (None: no row measured one)."""
        return max((row["peak_rss_bytes"] for row in self.rows if row.get("peak_rss_bytes")), default=None)

    def add(self, step_row: StepRow) -> None:
        row = step_row.to_row()
        self.rows.append(row)
        self.log.append(row)
        if self.trackers is not None:  # after the log: a row a tracker has is one the job has
            self.trackers.add(row)


def figures_by_step(plan: Plan, answers: Iterable[object], first: int) -> dict[int, tuple[StepReport, ...]]:
    """The ranks' reports of steps `first` on, in the answers of calls to them (a step's call answers each rank's
    list of the `StepReport`s it read, `Worker.run_step`; any other answer is skipped), by step, one per rank in rank
    order (a rank's latest where several answers hold its figures). Sat-out and rejoined answers (no figures) are
    left out."""
    by_step: dict[int, dict[int, StepReport]] = {}
    for answer in answers:
        for r in answer if isinstance(answer, list) else ():
            if isinstance(r, StepReport) and r.stats is not None and r.step >= first:
                by_step.setdefault(r.step, {})[plan.rank_of(r.stats.pp_rank, r.stats.tp_rank, r.dp_rank)] = r
    return {step: tuple(rows[rank] for rank in sorted(rows)) for step, rows in by_step.items()}


def make_row(step: int, results: Sequence[StepReport], elapsed: float, tokens: int,
             predicted_step_s: float | None = None) -> StepRow:
    """One step's row from every rank's results; `predicted_step_s`: the planner's prediction of the step time
    (`parallel: auto`), carried beside the measured `step_time_s` so a wrong cost model shows. The answers of
    a replica that sat the step out or only rejoined at its sync (`RankDriver.step`: no figures) are left out; the
    loss is the mean over the replicas' when they differ (local_sgd, diloco with a replica dropped: each has its
    own)."""
    sent = max(r.cross_replica_bytes for r in results)
    ran = [r for r in results if r.stats is not None]
    stats = [r.stats for r in results if r.stats is not None]
    last, last_loss = next((s, s.loss) for s in stats if s.loss is not None)
    losses = list({s.dp_rank: s.loss for s in stats if s.loss is not None}.values())
    rss = [r.peak_rss_bytes for r in ran if r.peak_rss_bytes is not None]
    compiled = max(s.compile_s for s in stats)
    moe = moe_metrics(stats)
    examples = sorted((r for r in ran if r.sample_ids is not None and r.stats is not None and r.stats.pp_rank == 0
                       and r.stats.tp_rank == 0), key=lambda r: r.dp_rank)
    val = [r.val_loss for r in ran if r.val_loss is not None]
    blocked = [r.checkpoint_blocked_s for r in ran if r.checkpoint_blocked_s is not None]
    failed = [r.checkpoint_error for r in ran if r.checkpoint_error is not None]
    stages = sorted(_first_pipeline(stats), key=lambda s: s.pp_rank)
    served = sorted((s for s in stats if s.ps_staleness is not None), key=lambda s: s.dp_rank)  # parameter_server
    busy = sum(s.forward_s + s.backward_s for s in stages)
    span = max(s.schedule_s for s in stages)
    return StepRow(
        step=step,
        loss=last_loss if len(set(losses)) == 1 else sum(losses) / len(losses),
        lr=last.lr,
        grad_norm=last.grad_norm,
        tokens_per_s=tokens / elapsed,
        step_time_s=elapsed,
        coordinator_overhead_s=max(0.0, elapsed - max(s.compute_s for s in stats)),
        # The first pipeline's stages (any whole one after a failure) and its measured bubble fraction:
        # 1 - (time the stages spent computing) / (pp x the longest stage's schedule wall time).
        bubble_fraction=max(0.0, 1.0 - busy / (len(stages) * span)) if span > 0 else 0.0,
        stage_forward_s=[s.forward_s for s in stages],
        stage_backward_s=[s.backward_s for s in stages],
        stage_peak_activations=[s.peak_activations for s in stages],
        stage_peak_activation_mb=[s.peak_activation_bytes / 2**20 for s in stages],
        reduce_bytes=max(s.reduce_bytes for s in stats),
        cross_replica_bytes=sent,
        peak_rss_bytes=max(rss) if rss else None,
        compile_s=compiled if compiled > 0 else None,
        predicted_step_s=predicted_step_s,
        moe=moe or None,
        # Whole examples (`data.packing`): the global batch's sample ids, and the epochs done.
        sample_ids=[i for r in examples for i in r.sample_ids or ()] if examples else None,
        epoch=examples[0].epoch if examples else None,
        val_loss=val[0] if val else None,
        checkpoint_blocked_s=max(blocked) if blocked else None,
        checkpoint_error=failed[0] if failed else None,  # every rank of a save says so alike
        ps_staleness=[s.ps_staleness for s in served if s.ps_staleness is not None] if served else None,
        ps_pace_s=[s.compute_s for s in served] if served else None,
    )


def checkpoint_event(row: StepRow) -> dict | None:
    """The event of the checkpoint the step wrote after it, if it wrote one."""
    if row.checkpoint_blocked_s is None:
        return None
    return {"time": time.time(), "kind": "checkpoint", "step": row.step + 1, "blocked_s": row.checkpoint_blocked_s}


def compile_event(row: StepRow) -> dict | None:
    """The event of the blocks compiled during the step (`compile: true`: the first step, and any recompile)."""
    if row.compile_s is None:
        return None
    return {"time": time.time(), "kind": "compile", "step": row.step, "compile_s": row.compile_s}


def set_gauges(job_id: str, row: StepRow, steps: int) -> None:
    step = row.step
    for key, gauge in _GAUGES.items():
        gauge.set(getattr(row, key) if key != "step" else step + 1, tags={"job_id": job_id})
    for key, gauge in _STAGE_GAUGES.items():
        for stage, value in enumerate(getattr(row, key)):
            gauge.set(value, tags={"job_id": job_id, "stage": str(stage)})
    for layer, values in (row.moe or {}).items():
        tags = {"job_id": job_id, "layer": layer}
        for key, gauge in _MOE_GAUGES.items():
            gauge.set(values[key], tags=tags)  # type: ignore[literal-required]  # _MOE_GAUGES' keys are its
        for expert, load in enumerate(values["load"]):
            _EXPERT_LOAD.set(load, tags={**tags, "expert": str(expert)})
    if step == 0 or (step + 1) % 10 == 0:
        log.info("job %s step %d/%d loss %.4f", job_id, step + 1, steps, row.loss)


def _first_pipeline(stats: Sequence[StepStats]) -> list[StepStats]:
    """The tensor-parallel rank 0 of every stage of the lowest data-parallel replica whose stages all answered."""
    pp = 1 + max(s.pp_rank for s in stats)
    d = complete_pipeline(stats, pp)
    return [s for s in stats if s.dp_rank == d and s.tp_rank == 0]


def moe_metrics(stats: Sequence[StepStats]) -> dict[str, MoELayerRow]:
    """Each MoE layer's statistics, keyed by its block index; every rank of a stage holds the stage's sums, so
    one pipeline's ranks have them all."""
    stages = _first_pipeline(stats)
    layers = {layer: cast(MoELayerRow, values) for s in stages for layer, values in s.moe.items()}
    return dict(sorted(layers.items(), key=lambda item: int(item[0])))
