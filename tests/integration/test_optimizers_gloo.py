"""The low-memory optimizers and offload on real gloo ranks, without Ray, as plans of one spawned world:
adamw8bit and adafactor train at (dp2, tp2) with ZeRO-1 and checkpoint after step 3; each checkpoint resumes
at dp1 (tp2, so no ZeRO-1 slices: the states are cut elsewhere on load) and follows the original curve; and
optimizer offload with activation offload (at the same layout, adamw8bit) gives the plain run's losses; and
the same over FSDP2's shards (ZeRO-3) instead of ZeRO-1's slices; and offload with its host steps overlapped with
the next forward (dp2, zero 0, with a validation pass and a checkpoint between steps) gives bitwise the losses and
parameters of the same offload stepped in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gloo_ranks import PlanRun, last_stage_losses, run_plans, stats_of
from helpers import tiny_spec
from trainyard.parallel.io.checkpoint import step_dir
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec

STEPS = 6
SAVED = 3
LAYOUT = {"dp": 2, "tp": 2, "zero": 1}
# d_model 64: the block matrices' tp shards and ZeRO-1 slices hold >= 4096 elements, which torchao quantizes
MODEL = {"n_layer": 2, "n_head": 2, "d_model": 64}
OPTIMIZERS = {"adamw8bit": {"kind": "adamw8bit"},
              "adafactor": {"kind": "adafactor", "lr": 0.05, "weight_decay": 0.0}}


def plan_for(optimizer: dict, parallel: dict, **more):
    return make_plan(parse_spec(tiny_spec(model=MODEL, steps=STEPS, optimizer=optimizer, parallel=parallel, **more)))


def quantized_states(driver, stats) -> int:
    """How many of this rank's optimizer state tensors are 8-bit (torchao's OptimState8bit)."""
    return sum(type(t).__name__ == "OptimState8bit" for o in driver.trainer.optimizer.optimizers
               for state in o.state.values() for t in state.values())


def overlap_and_params(driver, stats) -> tuple[bool, int, dict[str, torch.Tensor]]:
    """Whether the offloaded step ran behind the next forward, the forward units it waited by, the final
    parameters."""
    optimizer = driver.trainer.optimizer
    params = {n: p.detach().clone() for chunk in driver.trainer.chunks for n, p in chunk.named_parameters()}
    return optimizer.overlap, len(optimizer._unit_chunks), params


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list]:
    root = tmp_path_factory.mktemp("optimizers")
    plans = []
    for name, optimizer in OPTIMIZERS.items():
        plans.append((name, PlanRun(plan_for(optimizer, LAYOUT), save_after=(SAVED,), root=str(root / name),
                                    probe=quantized_states)))
    for name, optimizer in OPTIMIZERS.items():
        plans.append((f"{name}-dp1", PlanRun(plan_for(optimizer, {"tp": 2}),
                                             resume=(str(step_dir(root / name, SAVED)), SAVED))))
    offloaded = plan_for({**OPTIMIZERS["adamw8bit"], "offload": True}, LAYOUT, activation_offload=True)
    plans.append(("adamw8bit-offload", PlanRun(offloaded)))
    for name, optimizer in OPTIMIZERS.items():  # the same optimizers over FSDP2's shards (ZeRO-3)
        plans.append((f"{name}-zero3", PlanRun(plan_for(optimizer, {**LAYOUT, "zero": 3}))))
    plans.append(("adamw8bit-zero3-offload", PlanRun(plan_for({**OPTIMIZERS["adamw8bit"], "offload": True},
                                                             {**LAYOUT, "zero": 3}, activation_offload=True))))
    for name, overlap in (("offload-overlap", True), ("offload-in-place", False)):
        plans.append((name, PlanRun(plan_for({"offload": True, "offload_overlap": overlap}, {"dp": 2},
                                             eval={"every": 2, "batches": 1}),
                                    save_after=(SAVED,), evaluate_after=(2, 4), root=str(root / name),
                                    probe=overlap_and_params)))
    results = run_plans([run for _, run in plans])
    return {key: r for (key, _), r in zip(plans, results, strict=True)}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_low_memory_optimizer_resumes_at_another_layout_on_the_original_curve(runs, name):
    original, resumed = last_stage_losses(stats_of(runs[name])), last_stage_losses(stats_of(runs[f"{name}-dp1"]))
    assert original[-1] < original[0]  # it trains
    assert [s["step"] for s in stats_of(runs[f"{name}-dp1"])[-1]] == [3, 4, 5]
    # Not AdamW's 1e-4: at dp1 there are no ZeRO-1 slices, so the same moments are quantized in other blocks
    # (adamw8bit: 5e-5 measured) or factored over other rows where dp2's slice boundary cut a matrix
    # (adafactor: 6e-7 measured)
    np.testing.assert_allclose(resumed, original[SAVED:], rtol=5e-4 if name == "adamw8bit" else 1e-5)


def test_adamw8bit_quantizes_tp_shards_and_zero1_slices(runs):
    assert all(r.probe > 0 for r in runs["adamw8bit"])


def test_offloaded_optimizer_and_activations_give_the_plain_runs_losses(runs):
    plain, offloaded = stats_of(runs["adamw8bit"]), stats_of(runs["adamw8bit-offload"])
    np.testing.assert_allclose(last_stage_losses(offloaded), last_stage_losses(plain), rtol=1e-6, atol=0)
    for plain_rank, offloaded_rank in zip(plain, offloaded, strict=True):
        assert offloaded_rank[-1]["optimizer_bytes"] == 0
        assert offloaded_rank[-1]["optimizer_host_bytes"] > plain_rank[-1]["optimizer_bytes"] > 0
        assert offloaded_rank[-1]["peak_activation_bytes"] < plain_rank[-1]["peak_activation_bytes"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_low_memory_optimizer_over_zero3_shards_follows_its_zero1_curve(runs, name):
    zero1, zero3 = last_stage_losses(stats_of(runs[name])), last_stage_losses(stats_of(runs[f"{name}-zero3"]))
    # adamw8bit: the moments quantized in other blocks (5e-4, as above). adafactor factors each rank's piece:
    # ZeRO-3 gives each dp rank half of every matrix's rows, so its column means are over those rows only, a
    # different Adafactor from ZeRO-1's (which factors whole-row views): 1.8e-3 measured after 6 steps
    np.testing.assert_allclose(zero3, zero1, rtol=5e-4 if name == "adamw8bit" else 5e-3)


def test_offload_over_zero3_shards_gives_the_plain_zero3_losses(runs):
    plain, offloaded = stats_of(runs["adamw8bit-zero3"]), stats_of(runs["adamw8bit-zero3-offload"])
    np.testing.assert_allclose(last_stage_losses(offloaded), last_stage_losses(plain), rtol=1e-6, atol=0)
    assert all(rank[-1]["optimizer_bytes"] == 0 for rank in offloaded)


def test_a_diverging_job_fails_at_the_step_whose_loss_is_not_finite():
    # SGD at lr 1000 without clipping: the loss grows a thousandfold a step, then is NaN (one rank, tiny model)
    plan = make_plan(parse_spec(tiny_spec(model={"n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 8},
                                          steps=8, global_batch=2,
                                          optimizer={"kind": "sgd", "lr": 1e3, "warmup_steps": 0,
                                                     "min_lr_ratio": 1, "grad_clip": 0})))
    with pytest.raises(RuntimeError, match=r"DivergedError: step [1-7]: training diverged"):
        run_plans([PlanRun(plan)])


def test_offload_overlapped_with_the_next_forward_gives_bitwise_the_in_place_steps(runs):
    overlapped, in_place = runs["offload-overlap"], runs["offload-in-place"]
    assert all(r.probe[0] and r.probe[1] == 1 + MODEL["n_layer"] + 1 for r in overlapped)  # embedding, blocks, head
    assert not any(r.probe[0] for r in in_place)
    np.testing.assert_array_equal(last_stage_losses(stats_of(overlapped)), last_stage_losses(stats_of(in_place)))
    assert [s.get("val_loss") for s in stats_of(overlapped)[0]] == [s.get("val_loss") for s in stats_of(in_place)[0]]
    assert stats_of(overlapped)[0][-1]["optimizer_host_bytes"] == stats_of(in_place)[0][-1]["optimizer_host_bytes"]
    for a, b in zip(overlapped, in_place, strict=True):
        assert a.probe[2].keys() == b.probe[2].keys()
        assert all(torch.equal(a.probe[2][n], b.probe[2][n]) for n in a.probe[2])
