"""bench.perf's pure helpers: variant specs, the rotating order, step times and the loss check."""

from __future__ import annotations

import pytest
from trainyard.parallel.spec import parse_spec

from bench.perf import VARIANTS, loss_mismatch, paired_ratio, rotated, step_times, variant_spec


def test_each_variant_changes_only_its_own_field():
    base = parse_spec(variant_spec("base", 3))
    assert base.parallel.overlap_reduce and base.parallel.zero == 0 and base.activation_checkpointing == "none"
    no_overlap = parse_spec(variant_spec("no-overlap", 3))
    assert not no_overlap.parallel.overlap_reduce and no_overlap.parallel.dp == base.parallel.dp
    assert parse_spec(variant_spec("zero1", 3)).parallel.zero == 1
    assert parse_spec(variant_spec("full", 3)).activation_checkpointing == "full"
    assert set(VARIANTS) == {"base", "no-overlap", "zero1", "full", "selective"}


def test_rotation_puts_every_name_in_every_position():
    names = ["a", "b", "c"]
    orders = [rotated(names, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert rotated(names, 3) == names


def test_step_time_is_the_slower_rank_and_skips_warm_up():
    stats = [[{"compute_s": 9.0}, {"compute_s": 1.0}, {"compute_s": 2.5}],
             [{"compute_s": 8.0}, {"compute_s": 1.5}, {"compute_s": 2.0}]]
    assert step_times(stats, warmup=1) == [1.5, 2.5]


def test_loss_mismatch_is_the_largest_relative_difference():
    losses = {"base": [2.0, 4.0], "x": [2.0, 4.0004], "y": [1.999, 4.0]}
    assert loss_mismatch(losses, "base") == pytest.approx(5e-4)


def test_paired_ratio_cancels_drift_that_hits_both_sides():
    versus = [1.0, 2.0, 4.0]  # the machine slows down over the rounds
    times = [1.1, 2.2, 4.4]
    assert paired_ratio(times, versus) == pytest.approx(1.1)
