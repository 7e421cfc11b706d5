"""Gradient compression and compiled blocks in the spec, the plan's rules and `trainyard plan`'s bytes."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_spec
from trainyard.parallel.config import GradCompressionConfig
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.plan.grad_compression import approximation_rank
from trainyard.parallel.plan.present import describe
from trainyard.parallel.spec import SpecError, parse_spec


def test_spec_reads_grad_compression_and_compile():
    cfg = parse_spec(tiny_spec(compile=True, parallel={"dp": 2, "grad_compression": {"kind": "powersgd", "rank": 4,
                                                                                     "warmup_steps": 10}}))
    assert cfg.compile and cfg.parallel.grad_compression == GradCompressionConfig(rank=4, warmup_steps=10)
    assert parse_spec(tiny_spec()).parallel.grad_compression is None and not parse_spec(tiny_spec()).compile


@pytest.mark.parametrize("bad", [{"kind": "topk"}, {"rank": 0}, {"rank": 4, "ratio": 2}])
def test_spec_refuses_a_bad_grad_compression_naming_the_field(bad):
    with pytest.raises(SpecError, match="parallel.grad_compression"):
        parse_spec(tiny_spec(parallel={"dp": 2, "grad_compression": bad}))


def test_plan_refuses_powersgd_with_a_zero_that_shards_gradients():
    cfg = parse_spec(tiny_spec(parallel={"dp": 2, "zero": 1, "grad_compression": {"rank": 2}}))
    make_plan(cfg)  # ZeRO-1 keeps whole gradients: it composes
    sharded = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=2))
    with pytest.raises(PlanError, match="powersgd needs every rank's whole gradients") as err:
        make_plan(sharded)
    assert err.value.field == "parallel.grad_compression"


def test_only_matrices_that_gain_are_compressed_at_at_most_their_rank():
    cfg = GradCompressionConfig(rank=4)
    assert approximation_rank(128, 512, cfg) == 4
    assert approximation_rank(8, 8, cfg) is None  # 64 elements vs 2 x 16 x 4 = 128: sent whole
    assert approximation_rank(3, 1000, GradCompressionConfig(rank=4, min_compression_rate=0)) == 3


def test_plan_shows_the_bytes_a_rank_sends_per_step():
    spec = tiny_spec(model={"d_model": 128}, parallel={"dp": 2, "pp": 2})
    plain = describe(make_plan(parse_spec(spec)))["reduction"]
    assert plain["compression"] is None and len(plain["per_stage"]) == 2
    assert all(s["sent"] == s["uncompressed"] > 0 for s in plain["per_stage"])
    spec["parallel"]["grad_compression"] = {"rank": 4}
    compressed = describe(make_plan(parse_spec(spec)))["reduction"]
    for before, after in zip(plain["per_stage"], compressed["per_stage"], strict=True):
        assert after["uncompressed"] == before["uncompressed"] and after["sent"] < before["sent"] / 10
    alone = describe(make_plan(parse_spec(tiny_spec())))["reduction"]["per_stage"]
    assert alone == [{"uncompressed": 0, "sent": 0}]  # dp=1: no other rank to reduce with


def test_a_step_that_compiled_is_a_compile_event_of_the_job():
    from step_helpers import step_row
    from trainyard.actors.telemetry import compile_event

    event = compile_event(step_row(0, compile_s=12.5))
    assert event is not None and (event["kind"], event["step"], event["compile_s"]) == ("compile", 0, 12.5)
    assert compile_event(step_row(1)) is None


def test_the_runtime_registry_and_the_plans_table_name_the_same_compressors():
    """A compressor is a `parallel.runtime.compression.COMPRESSORS` entry (how it runs) and a
    `parallel.plan.grad_compression.COMPRESSIONS` entry (what it sends and keeps): the two, and the spec's kinds,
    agree; PowerSGD's plan bytes are its two fp32 factors and what it keeps for them."""
    from typing import get_args, get_type_hints

    from trainyard.parallel.plan.grad_compression import COMPRESSIONS, Compressed
    from trainyard.parallel.plan.grad_compression import NAMES as PLAN_NAMES
    from trainyard.parallel.runtime.compression import NAMES

    assert NAMES == PLAN_NAMES and set(get_args(get_type_hints(GradCompressionConfig)["kind"])) == set(NAMES)
    psgd = COMPRESSIONS["powersgd"]
    assert psgd.matrix(128, 512, GradCompressionConfig(rank=4)) == Compressed(sent=4 * 640 * 4,
                                                                               kept=4 * (128 * 512 + 2 * 640 * 4))
    assert psgd.matrix(8, 8, GradCompressionConfig(rank=4)) is None and psgd.whole_gradients
