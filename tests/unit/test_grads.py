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


@pytest.mark.parametrize("bad,field", [
    ({"kind": "lowrank"}, "kind"), ({"rank": 0}, "rank"), ({"rank": 4, "ratio": 2}, "ratio"),
    ({"kind": "topk", "ratio": 0}, "ratio"), ({"kind": "topk", "ratio": 1.5}, "ratio"),
    ({"kind": "topk", "ratio": True}, "ratio"), ({"kind": "topk", "error_feedback": 2}, "error_feedback"),
    ({"kind": "qsgd", "levels": 0}, "levels"), ({"kind": "qsgd", "levels": 128}, "levels"),
    ({"kind": "qsgd", "levels": 2.5}, "levels"), ({"kind": "qsgd", "bucket_size": 0}, "bucket_size"),
])
def test_spec_refuses_a_bad_grad_compression_naming_the_field(bad, field):
    with pytest.raises(SpecError) as err:
        parse_spec(tiny_spec(parallel={"dp": 2, "grad_compression": bad}))
    assert [f for f, _ in err.value.errors] == [f"parallel.grad_compression.{field}"]


@pytest.mark.parametrize("compression", [{"rank": 2}, {"kind": "topk"}, {"kind": "qsgd"}])
@pytest.mark.parametrize("zero", [2, 3])
def test_plan_refuses_a_compressor_with_a_zero_that_shards_gradients(compression, zero):
    cfg = parse_spec(tiny_spec(parallel={"dp": 2, "zero": 1, "grad_compression": compression}))
    make_plan(cfg)  # ZeRO-1 keeps whole gradients: it composes
    sharded = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=zero))
    with pytest.raises(PlanError, match=f"{cfg.parallel.grad_compression.kind} needs every rank's whole "
                                        "gradients") as err:
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


@pytest.mark.parametrize("compression,share", [
    ({"kind": "topk", "ratio": 0.01}, 0.02), ({"kind": "topk", "ratio": 1.0}, 2.0),
    ({"kind": "qsgd", "levels": 7}, 1 / 8 + 1 / 512), ({"kind": "qsgd", "levels": 1}, 1 / 16 + 1 / 512),
    ({"kind": "qsgd", "levels": 127, "bucket_size": 64}, 1 / 4 + 1 / 64),
])
def test_plan_counts_what_topk_and_qsgd_send_and_keep(compression, share):
    """Top-k sends 8 bytes (index, value) per kept element, QSGD 2, 4 or 8 bits an element and a norm per bucket:
    against fp32's 4 bytes an element, over the matrices (the 1-D tensors go whole). What they keep beside the
    buckets grows with the group (the gathered codes)."""
    from trainyard.parallel.plan.reduction_bytes import compression_state_bytes

    def planned(dp: int, grad_compression=None):
        plan = make_plan(parse_spec(tiny_spec(model={"d_model": 128}, parallel={
            "dp": dp, **({"grad_compression": grad_compression} if grad_compression else {})})))
        [stage] = describe(plan)["reduction"]["per_stage"]
        return stage, compression_state_bytes(plan, 0)

    (plain, _), (compressed, kept) = planned(2), planned(2, compression)
    assert compressed["uncompressed"] == plain["sent"]
    # of fp32's bytes: the matrices' share, and the 1-D tensors whole (under 1% of the elements here)
    assert 0.99 * share <= compressed["sent"] / plain["sent"] <= share + 0.01
    assert planned(4, compression)[1] > kept > 0


def test_a_step_that_compiled_is_a_compile_event_of_the_job():
    from step_helpers import step_row
    from trainyard.actors.telemetry import compile_event

    event = compile_event(step_row(0, compile_s=12.5))
    assert event is not None and (event["kind"], event["step"], event["compile_s"]) == ("compile", 0, 12.5)
    assert compile_event(step_row(1)) is None


def test_the_runtime_registry_and_the_plans_table_name_the_same_compressors():
    """A compressor is a `parallel.runtime.compression.COMPRESSORS` entry (how it runs) and a
    `parallel.plan.grad_compression.COMPRESSIONS` entry (what it sends and keeps): the two, and the spec's kinds,
    agree; PowerSGD's plan bytes are its two fp32 factors and what it keeps for them, top-k's its (index, value)
    pairs and residual, QSGD's its packed codes and norms."""
    from typing import get_args, get_type_hints

    from trainyard.parallel.plan.grad_compression import COMPRESSIONS, Compressed
    from trainyard.parallel.plan.grad_compression import NAMES as PLAN_NAMES
    from trainyard.parallel.runtime.compression import NAMES

    assert NAMES == PLAN_NAMES and set(get_args(get_type_hints(GradCompressionConfig)["kind"])) == set(NAMES)
    psgd = COMPRESSIONS["powersgd"]
    assert psgd.matrix(128, 512, GradCompressionConfig(rank=4), 2) == Compressed(sent=4 * 640 * 4,
                                                                                  kept=4 * (128 * 512 + 2 * 640 * 4))
    assert psgd.matrix(8, 8, GradCompressionConfig(rank=4), 2) is None and psgd.whole_gradients
    topk = COMPRESSIONS["topk"].matrix
    # k = ceil(0.1 x 30) = 3 as written (binary 0.1 x 30 is a hair above 3); 8 bytes a pair; residual fp32
    assert topk(5, 6, GradCompressionConfig(kind="topk", ratio=0.1), 4) == Compressed(sent=24, kept=4 * 30 + 24 * 5)
    assert topk(5, 6, GradCompressionConfig(kind="topk", ratio=0.1, error_feedback=False), 4).kept == 24 * 5
    assert topk(1, 1000, GradCompressionConfig(kind="topk", ratio=1e-9), 2).sent == 8  # at least one element
    qsgd = COMPRESSIONS["qsgd"].matrix
    # 4-bit codes (levels 7: 0..14), 30 -> 15 bytes, and one fp32 norm per 16 elements (2)
    assert qsgd(5, 6, GradCompressionConfig(kind="qsgd", levels=7, bucket_size=16), 4) == Compressed(
        sent=15 + 8, kept=23 * 5)
    assert qsgd(5, 6, GradCompressionConfig(kind="qsgd", levels=8, bucket_size=512), 2).sent == 30 + 4  # 8-bit


@pytest.mark.parametrize("compression,field", [({"kind": "topk", "ratio": 0}, "ratio"),
                                               ({"kind": "qsgd", "levels": 200}, "levels")])
def test_the_api_answers_a_bad_ratio_or_levels_with_a_422_naming_it_and_creates_nothing(tmp_path, compression,
                                                                                         field):
    from fastapi.testclient import TestClient
    from trainyard.api.app import create_app
    from trainyard.service.manager import JobManager
    from trainyard.service.store import JobStore

    # A manager without Ray that admits nothing: the spec is refused before anything would be planned.
    manager = JobManager(JobStore(tmp_path / "jobs.db"), admit=False)
    client = TestClient(create_app(manager=manager, token="t"), raise_server_exceptions=True)
    spec = tiny_spec(parallel={"dp": 2, "grad_compression": compression})
    for path in ("/api/jobs", "/api/plans"):
        bad = client.post(path, headers={"Authorization": "Bearer t"}, json=spec)
        assert bad.status_code == 422, bad.text
        [detail] = bad.json()["detail"]
        assert detail["field"] == f"parallel.grad_compression.{field}"
    assert manager.list() == []
    manager.shutdown()
