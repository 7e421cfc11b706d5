"""PipeDream-2BW (`parallel.schedule: 2bw`) on real gloo ranks at pp=2: each step's gradient is of the weights one
step old, w_{t+1} = w_t - lr * g(w_{t-1}); its losses equal a one-rank reference that applies every update one step
late, written out by hand (plain SGD: the update is -lr times the gradient), within 1e-5, and differ from the same
job's without the delay."""

from __future__ import annotations

import numpy as np
import torch
from gloo_ranks import PlanRun, last_stage_losses, run_plans, stats_of
from helpers import tiny_spec
from trainyard.parallel.data.datasets import open_dataset
from trainyard.parallel.data.sampler import global_batch_ids, rank_share
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec

STEPS, BATCH = 5, 8
PLAIN_SGD = {"kind": "sgd", "lr": 0.2, "beta1": 0.0, "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 0}


def plan_for(parallel: dict):
    return make_plan(parse_spec(tiny_spec(steps=STEPS, global_batch=BATCH, parallel=parallel, optimizer=PLAIN_SGD)))


def one_step_late_by_hand(driver, stats) -> dict:
    """A one-rank trainer whose every step computes on the previous weights and adds its update to the newest;
    and one that steps plainly."""
    plan = driver.plan
    late, plain = driver.trainer_for(plan), driver.trainer_for(plan)
    params = [p for chunk in late.chunks for p in chunk.parameters()]
    older = [p.detach().clone() for p in params]
    num_samples, out = open_dataset(plan.config).num_samples, {"late": [], "plain": []}
    for step in range(STEPS):
        ids = rank_share(global_batch_ids(plan.config.seed, step, BATCH, num_samples), 0, 1, plan.microbatches)
        with torch.no_grad():
            newer = [p.detach().clone() for p in params]
            for p, old in zip(params, older, strict=True):
                p.copy_(old)
        out["late"].append(late.train_step(step, ids).loss)  # p is now w_{t-1} - lr g(w_{t-1})
        with torch.no_grad():
            for p, old, new in zip(params, older, newer, strict=True):
                p.copy_(new + (p - old))  # w_{t+1} = w_t - lr g(w_{t-1})
        older = newer
        out["plain"].append(plain.train_step(step, ids).loss)
    return out


def test_2bw_at_pp2_equals_applying_each_update_one_step_late():
    two_bw, by_hand = run_plans([
        PlanRun(plan_for({"pp": 2, "microbatches": 2, "schedule": "2bw"})),
        PlanRun(plan_for({"microbatches": 2}), steps=range(0), probe=one_step_late_by_hand),
    ])
    losses, reference = last_stage_losses(stats_of(two_bw)), by_hand[0].probe
    np.testing.assert_allclose(losses, reference["late"], rtol=1e-5)
    assert np.isclose(losses[0], reference["plain"][0], rtol=1e-5)  # the first step: the initial weights either way
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses[2:], reference["plain"][2:], strict=True))  # the delay is real
