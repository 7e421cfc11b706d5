"""The memory plan against what real gloo ranks hold (no Ray).

Each rank builds its RankDriver, runs one step, and reports its local parameter bytes (a DTensor's local
shard), its gradient buckets (and ZeRO-1's reduced slices), its optimizer's state (`optimizer_bytes`) and the
pipeline meter's peak of bytes saved for backward; the plan's estimate must match the first three (up to
the buckets' padding to a multiple of the group size) and the activations within 25%.
"""

from __future__ import annotations

import pytest
from gloo_ranks import PlanRun, run_plans
from helpers import tiny_spec
from trainyard.api.spec import parse_spec
from trainyard.parallel.data_parallel import local_part
from trainyard.parallel.driver import RankDriver
from trainyard.parallel.plan import make_plan

MOE = {"experts": 4, "top_k": 2, "every": 2}


def measure(driver: RankDriver, stats: list[dict]) -> dict[str, int]:
    """What this rank holds after its step: parameters, gradient buckets, optimizer state, activations' peak."""
    trainer = driver.trainer
    params = {id(p): local_part(p) for chunk in trainer.chunks for p in chunk.parameters()}
    buckets = [t for reducer in trainer.reducers.values() for b in reducer.buckets for t in (b.flat, b.shard)
               if t is not None]
    return {
        "params": sum(p.numel() * p.element_size() for p in params.values()),
        "grads": sum(t.numel() * t.element_size() for t in buckets),
        "optimizer": stats[-1]["optimizer_bytes"],
        "activations": stats[-1]["peak_activation_bytes"],
    }


LAYOUTS = {
    "pp2-1f1b-m4": {"parallel": {"pp": 2, "microbatches": 4}},
    "pp2-vpp2-interleaved-bf16-full": {"precision": "bf16", "activation_checkpointing": "full",
                                       "parallel": {"pp": 2, "vpp": 2, "microbatches": 4,
                                                    "schedule": "interleaved-1f1b"}},
    "tp2-sp-bf16-selective": {"precision": "bf16", "activation_checkpointing": "selective",
                              "parallel": {"tp": 2, "sp": True, "microbatches": 2}},
    "moe-dp2-ep2-zero1-gpipe-selective": {"model": {"moe": MOE}, "activation_checkpointing": "selective",
                                          "parallel": {"dp": 2, "ep": 2, "zero": 1, "microbatches": 2,
                                                       "schedule": "gpipe"}},
    # split backward: an activation is held until its weight half; the V puts the first and last stage on rank 0
    "pp2-zbv-m4": {"parallel": {"pp": 2, "vpp": 2, "microbatches": 4, "schedule": "zbv"}},
}


def plan_for(layout: str):
    overrides = LAYOUTS[layout]
    model = {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 32, **overrides.get("model", {})}
    return make_plan(parse_spec(tiny_spec(**{**overrides, "model": model, "steps": 1, "global_batch": 8})))


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict[str, int]]]:
    """[rank] measurements of every layout after one step, from one spawned world."""
    results = run_plans([PlanRun(plan_for(layout), probe=measure) for layout in LAYOUTS])
    return {layout: [r.probe for r in ranks] for layout, ranks in zip(LAYOUTS, results, strict=True)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_memory_plan_matches_what_the_ranks_hold(layout, measured):
    for rank, expected in enumerate(plan_for(layout).memory()):
        got = measured[layout][rank]
        assert got["params"] == expected.params, rank
        assert got["grads"] == pytest.approx(expected.grads, abs=64), rank  # padding: a few elements a bucket
        assert got["optimizer"] == pytest.approx(expected.optimizer, abs=64), rank
        assert got["activations"] == pytest.approx(expected.activations, rel=0.25), rank
        print(f"{layout} rank {rank}: " + ", ".join(f"{k} {getattr(expected, k)} vs {v}" for k, v in got.items()))
