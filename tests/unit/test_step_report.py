"""A rank's answer for a step, typed (`StepReport`, built where the Worker actor returns `RankDriver`'s figures), and
the step's metrics row (`StepRow`): every dict the driver returns reads as a report (a key the report does not know
raises), and what leaves the coordinator (`StepRow.to_row()`: the metrics log, the trackers, the service's polls) is
the row it always was, key for key and in the same order."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from step_helpers import step_report
from trainyard.actors.telemetry import make_row
from trainyard.parallel.config import DataConfig, EvalConfig, JobConfig, ModelConfig, ParallelConfig
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.local_world import free_ports
from trainyard.parallel.runtime.step.step_stats import Save, StepReport


@pytest.fixture(scope="module")
def driver() -> Iterator[RankDriver]:
    """One rank of a tiny job, gloo at world size 1 (a worker's `RankDriver` as is)."""
    cfg = JobConfig(name="reports", model=ModelConfig(n_layer=1, n_head=2, d_model=16, vocab_size=64, seq_len=8),
                    steps=4, data=DataConfig(kind="synthetic"), global_batch=2, parallel=ParallelConfig(),
                    eval=EvalConfig(every=2, batches=1))
    driver = RankDriver(make_plan(cfg), 0, "127.0.0.1", free_ports(1)[0], torch.device("cpu"), 60)
    yield driver
    driver.close()


def test_every_answer_of_the_driver_reads_as_a_step_report(driver, tmp_path):
    plain = driver.queue_step(0) + driver.queue_step(1, evaluate=True, save=Save(tmp_path, {}))
    sat_out = driver.queue_step(2, round_={"live": (), "rejoining": ()})  # its replica sits the step out
    reports = [StepReport.of(figures, peak_rss_bytes=123) for figures in plain + sat_out + driver.flush()]
    assert [(r.step, r.stats is not None, r.sat_out) for r in reports] == [(0, True, False), (1, True, False),
                                                                          (2, False, True)]
    first, evaluated, skipped = reports
    assert first.stats is not None and first.stats.to_dict() == plain[0] and first.peak_rss_bytes == 123
    assert evaluated.val_loss == plain[1]["val_loss"] is not None
    assert evaluated.checkpoint_blocked_s == plain[1]["checkpoint_blocked_s"] and evaluated.checkpoint_error is None
    assert (skipped.dp_rank, skipped.cross_replica_bytes) == (0, 0)
    with pytest.raises(TypeError, match="unknown"):
        StepReport.of({**plain[0], "unknown": 1})


def test_a_rejoined_rank_reports_its_sync_only():
    report = StepReport.of({"step": 7, "dp_rank": 2, "rejoined": True, "cross_replica_bytes": 4096})
    assert report.stats is None and report.rejoined and report.cross_replica_bytes == 4096


def test_the_row_that_leaves_the_coordinator_is_the_dict_it_always_was():
    ranks = [step_report(step=3, dp_rank=d, loss=2.0 + d, compute_s=0.2 + d, reduce_bytes=10 * (d + 1), forward_s=0.25,
                         backward_s=0.5, schedule_s=1.0,
                         cross_replica_bytes=100, compile_s=1.5, peak_rss_bytes=1000 + d, sample_ids=[2 * d, 2 * d + 1],
                         epoch=0, val_loss=1.25, checkpoint_blocked_s=0.1 + d,
                         moe={"1": {"aux_loss": 1.0, "z_loss": 0.0, "dropped_fraction": 0.0, "load": [3, 1]}})
             for d in range(2)]
    sat = StepReport.of({"step": 3, "dp_rank": 2, "sat_out": True}, peak_rss_bytes=5000)
    row = make_row(3, [*ranks, sat], elapsed=0.5, tokens=256, predicted_step_s=0.4).to_row()
    expected = {
        "step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 512.0, "step_time_s": 0.5,
        "coordinator_overhead_s": 0.0, "bubble_fraction": 0.25, "stage_forward_s": [0.25], "stage_backward_s": [0.5],
        "stage_peak_activations": [2], "stage_peak_activation_mb": [1.0], "reduce_bytes": 20,
        "cross_replica_bytes": 100, "peak_rss_bytes": 1001, "compile_s": 1.5, "predicted_step_s": 0.4,
        "moe": {"1": {"aux_loss": 1.0, "z_loss": 0.0, "dropped_fraction": 0.0, "load": [3, 1]}},
        "sample_ids": [0, 1, 2, 3], "epoch": 0, "val_loss": 1.25, "checkpoint_blocked_s": 1.1,
    }
    assert json.dumps(row) == json.dumps(expected)  # the same keys, in the same order, with the same values
    lean = make_row(3, ranks[:1], elapsed=0.5, tokens=256).to_row()
    assert "predicted_step_s" not in lean and "val_loss" in lean and "replica_steps" not in lean
