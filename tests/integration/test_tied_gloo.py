"""Tied embeddings across pipeline chunks (`parallel.runtime.pipeline.tied`) at every schedule and ZeRO stage, with tp,
recompute and bf16, on 4 gloo ranks: each layout follows the one-rank pp=1 run (one tied tensor) within 1e-4, loss
and clipped gradient norm (the tied weight counted once), and the embedding and its head copy are bitwise equal
after training; a checkpoint holds one tensor for both and resumes at another pp, pp=1 to pp=2 and back, the V
placement (both copies on one rank) and ZeRO-3 included, on the uninterrupted run's curve. In `make test-slow`:
test_hf_gloo.py's 3D world covers the case in `make test`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_ranks import PlanRun, run_plans
from helpers import SLOW, tiny_spec
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.spec import parse_spec

pytestmark = SLOW
ATOL = 1e-4
LAYOUTS = {
    "pp2-1f1b": {"pp": 2, "microbatches": 4},
    "pp2-gpipe-recompute": {"pp": 2, "microbatches": 4, "schedule": "gpipe"},
    "pp2-zb-h1": {"pp": 2, "microbatches": 4, "schedule": "zb-h1"},
    "pp2-vpp2-interleaved": {"pp": 2, "vpp": 2, "microbatches": 4, "schedule": "interleaved-1f1b"},
    "pp2-vpp2-zbv": {"pp": 2, "vpp": 2, "microbatches": 4, "schedule": "zbv"},  # both copies on rank 0
    "dp2-pp2-zero1": {"dp": 2, "pp": 2, "microbatches": 2, "zero": 1},
    "dp2-pp2-zero2": {"dp": 2, "pp": 2, "microbatches": 2, "zero": 2},
    "dp2-pp2-zero3": {"dp": 2, "pp": 2, "microbatches": 2, "zero": 3},
    "pp2-tp2": {"pp": 2, "tp": 2, "microbatches": 4},
}


def plan_for(parallel: dict, **overrides) -> Plan:
    spec = tiny_spec(model={"tie_embeddings": True, "n_layer": 4}, steps=3, parallel=parallel,
                     optimizer={"lr": 1e-2, "warmup_steps": 0, "grad_clip": 0.05}, **overrides)  # clipping on
    return make_plan(parse_spec(spec))


def copies(driver: RankDriver, stats: list[dict]) -> dict:
    """This rank's copies of the tied embedding (local parts), by its (dp, tp) coordinates."""
    from trainyard.parallel.runtime.tp.local_parts import local_part

    tied, c = driver.trainer.tied, driver.trainer.coords
    held = {"embedding": tied.embedding, "head": tied.head}
    return {"coords": (c.dp, c.tp), **{k: local_part(p).detach().clone() for k, p in held.items() if p is not None}}


def curve(results) -> tuple[list[float], list[float]]:
    """(losses, gradient norms) of a run's steps."""
    stats = next(r.stats for r in results if r.stats[0]["loss"] is not None)
    return [s["loss"] for s in stats], [s["grad_norm"] for s in stats]


def assert_tied_equal(results) -> None:
    embeddings = {r.probe["coords"]: r.probe["embedding"] for r in results if "embedding" in r.probe}
    heads = {r.probe["coords"]: r.probe["head"] for r in results if "head" in r.probe}
    assert embeddings and embeddings.keys() == heads.keys()
    for coords, embedding in embeddings.items():
        assert torch.equal(embedding, heads[coords]), coords


def assert_follows(got: list[float], want: list[float], atol: float = ATOL) -> None:
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < atol, (got, want)


@pytest.fixture(scope="module")
def runs():
    plans = {"pp1": plan_for({"microbatches": 4})} | {name: plan_for(par) for name, par in LAYOUTS.items()}
    plans["pp2-gpipe-recompute"] = plan_for(LAYOUTS["pp2-gpipe-recompute"], activation_checkpointing="full")
    plans |= {"pp1-bf16": plan_for({"microbatches": 4}, precision="bf16"),
              "dp2-pp2-bf16": plan_for({"dp": 2, "pp": 2, "microbatches": 2}, precision="bf16")}
    results = run_plans([PlanRun(plan, probe=copies) for plan in plans.values()])
    return dict(zip(plans, results, strict=True))


@pytest.mark.parametrize("name", [*LAYOUTS, "dp2-pp2-bf16"])
def test_each_layout_follows_pp1_with_the_copies_bitwise_equal(runs, name):
    reference = runs["pp1-bf16" if "bf16" in name else "pp1"]
    (losses, norms), (want_losses, want_norms) = curve(runs[name]), curve(reference)
    assert_follows(losses, want_losses)
    assert_follows(norms, want_norms)  # the tied weight counted once; above grad_clip, so clipping scaled both
    assert min(norms) > 0.05
    assert_tied_equal(runs[name])


def test_a_checkpoint_holds_one_tensor_and_resumes_at_another_pp(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    straight = plan_for({"microbatches": 4})
    saved = {"pp2": plan_for({"dp": 2, "pp": 2, "microbatches": 2, "zero": 1}), "pp1": straight}
    first = run_plans([PlanRun(straight, probe=copies)] + [
        PlanRun(plan, save_after=(1,), root=str(tmp_path / name), probe=copies) for name, plan in saved.items()])
    for name in saved:
        names = dcp.FileSystemReader(str(checkpoint.step_dir(tmp_path / name, 1))).read_metadata().state_dict_metadata
        assert "model.wte.weight" in names and not any("lm_head" in key for key in names)
    resumed = {("pp2", "pp1"): straight, ("pp2", "zbv"): plan_for(LAYOUTS["pp2-vpp2-zbv"]),
               ("pp1", "pp2-tp2"): plan_for(LAYOUTS["pp2-tp2"]), ("pp1", "zero3"): plan_for(LAYOUTS["dp2-pp2-zero3"])}
    second = run_plans([PlanRun(plan, resume=(str(checkpoint.step_dir(tmp_path / source, 1)), 1), probe=copies)
                        for (source, _), plan in resumed.items()])
    want = curve(first[0])[0][1:]
    for key, results in zip(resumed, second, strict=True):
        assert_follows(curve(results)[0], want), key
        if key[1] != "pp1":
            assert_tied_equal(results)
