"""Gossip averaging (`parallel.sync.kind: gossip`) on real gloo ranks, without Ray, all plans in one spawned world:

- with every other replica as a peer (dp=4, peers=3) a gossip round is local_sgd's mean (every replica's
  parameters after it are the replicas' mean before it, within 1e-6), sent point to point: three copies of the
  parameters per round instead of one all-reduce's; in `make test-slow`, the whole run against local_sgd's
  (AdamW: losses and parameters within 1e-6);
- at dp=2 with one peer, every step and a linear inner step (plain SGD), gossip equals all-reduce;
- a replica dropped after a failure sits out, then rejoins at the next sync (local_sgd's machinery: the sync
  with replicas out of the round is the live replicas' mean) and takes the live replica's state;
- on a ring with one peer (dp=4), the job trains (its loss falls), and each round replaces each replica's
  parameters by the mean of its own and its one peer's (`gossip_peers`): the replicas differed before it and
  agree more after it, and their mean is what it was (the pairing is doubly stochastic).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from gloo_ranks import PlanRun, RankResult, run_plans, stats_of
from helpers import SLOW_TESTS, slow, tiny_spec
from test_sync_gloo import drop_and_rejoin, final_params, last_stage_losses
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.sync.gossip_peers import gossip_peers
from trainyard.parallel.spec import parse_spec

STEPS, EVERY = 4, 2
NO_CLIP = {"optimizer": {"kind": "sgd", "lr": 0.05, "grad_clip": 0.0, "warmup_steps": 2}}


def plan_for(dp: int, sync: dict | None = None, **spec):
    parallel = {"dp": dp, **({"sync": sync} if sync else {})}
    return make_plan(parse_spec(tiny_spec(steps=STEPS, global_batch=8, parallel=parallel, **spec)))


def record_syncs(driver) -> None:
    """Wrap this rank's sync so that each call leaves (step, whole, its flat parameters before and after)."""
    sync, log = driver.trainer.sync, []
    original = sync.synchronise

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in sync.params]).clone()

    def recording(*args, **kwargs):
        before = flat()
        sent = original(*args, **kwargs)
        log.append({"step": kwargs["step"], "whole": kwargs["whole"], "before": before, "after": flat(),
                    "replica": dist.get_rank(sync.group), "sent": sent})
        return sent

    sync.synchronise = recording
    driver.gossip_log = log


def sync_log(driver, stats) -> list[dict]:
    return driver.gossip_log


def logged_params(driver, stats) -> dict:
    return {"log": driver.gossip_log, "params": final_params(driver, stats)}


RING = {"kind": "gossip", "every": 1, "peers": 1, "topology": "ring"}
RECORDED = ("gossip-all", "ring")
RUNS = {
    **({"local_sgd": (plan_for(4, {"kind": "local_sgd", "every": EVERY}), final_params)} if SLOW_TESTS else {}),
    "gossip-all": (plan_for(4, {"kind": "gossip", "every": EVERY, "peers": 3, "topology": "random"}), logged_params),
    "allreduce-dp2": (plan_for(2, **NO_CLIP), final_params),
    "gossip-dp2": (plan_for(2, {"kind": "gossip", "every": 1, "peers": 1}, **NO_CLIP), final_params),
    "ring": (plan_for(4, RING, optimizer={"lr": 1e-2}), sync_log),
}
DROPPED = make_plan(parse_spec(tiny_spec(steps=8, global_batch=8, parallel={"dp": 2, "sync": {
    "kind": "gossip", "every": 4, "peers": 1}})))

_cache: dict = {}


def runs() -> dict:
    if not _cache:
        named = [(key, PlanRun(plan, probe=probe, at_start=record_syncs if key in RECORDED else None))
                 for key, (plan, probe) in RUNS.items()]
        named.append(("dropped", PlanRun(DROPPED, steps=range(0), probe=drop_and_rejoin)))
        results = run_plans([run for _, run in named])
        _cache.update({key: r for (key, _), r in zip(named, results, strict=True)})
    return _cache


def assert_same_run(run, reference, rtol: float) -> None:
    np.testing.assert_allclose(last_stage_losses(stats_of(run)), last_stage_losses(stats_of(reference)), rtol=rtol)
    for rank in range(len(reference)):
        for name, p in reference[rank].probe.items():
            if name.endswith("attn.k.bias"):
                # Its gradient is zero in exact arithmetic (softmax ignores a query's constant shift); AdamW scales
                # the rounding noise left there to full-size steps, so a sum in another order moves it by ~lr
                # (see test_sync_gloo's diloco test).
                continue
            torch.testing.assert_close(run[rank].probe[name], p, rtol=rtol, atol=1e-7,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_gossip_with_every_other_replica_as_a_peer_is_local_sgd_sent_point_to_point():
    gossip = runs()["gossip-all"]
    logs = {r.probe["log"][0]["replica"]: r.probe["log"] for r in gossip}
    gossiped, whole = logs[0]
    assert (gossiped["step"], gossiped["whole"], whole["whole"]) == (EVERY - 1, False, True)
    before = torch.stack([logs[i][0]["before"] for i in range(4)])
    assert float((before - before.mean(0)).norm()) > 0  # the replicas stepped apart
    for i in range(4):  # local_sgd's average, from three point-to-point messages
        torch.testing.assert_close(logs[i][0]["after"], before.mean(0), rtol=1e-6, atol=1e-7)
    sent = [s["cross_replica_bytes"] for s in gossip[0].stats]
    numel = before.shape[1]
    # the round after step 1 sends the parameters to three peers; the last is whole, one all-reduce's
    assert sent == [0, 3 * 4 * numel, 0, 4 * numel]


@slow
def test_a_gossip_run_with_every_other_replica_as_a_peer_is_local_sgds_run():
    gossip, local = runs()["gossip-all"], runs()["local_sgd"]
    assert_same_run([RankResult(r.stats, r.probe["params"]) for r in gossip], local, rtol=1e-6)


def test_gossip_at_dp2_with_one_peer_every_step_equals_all_reduce_with_a_linear_inner_step():
    assert_same_run(runs()["gossip-dp2"], runs()["allreduce-dp2"], rtol=1e-5)


def test_a_ring_round_averages_each_replica_with_its_peer_and_brings_them_closer():
    ring = runs()["ring"]
    losses = last_stage_losses(stats_of(ring))
    assert losses[-1] < losses[0]  # it trains
    logs = {r.probe[0]["replica"]: r.probe for r in ring}
    for call in range(STEPS - 1):  # the rounds before the last, whole one
        step = logs[0][call]["step"]
        assert not logs[0][call]["whole"]
        before = torch.stack([logs[i][call]["before"] for i in range(4)])
        after = torch.stack([logs[i][call]["after"] for i in range(4)])
        graph = gossip_peers(7, step, 1, 4, 1, "ring")
        for i in range(4):
            torch.testing.assert_close(after[i], (before[i] + before[graph[i][0]]) / 2, rtol=0, atol=1e-7)
        spread = [float((x - x.mean(0)).norm()) for x in (before, after)]
        assert spread[0] > 0 and spread[1] < spread[0]  # they differed, and agree more
        torch.testing.assert_close(after.mean(0), before.mean(0), rtol=1e-6, atol=1e-7)  # the mean is kept
        assert logs[0][call]["sent"] == 4 * before.shape[1]  # one peer: one copy of the parameters
    assert logs[0][-1]["whole"]  # the last sync leaves one model
    assert all(torch.equal(logs[i][-1]["after"], logs[0][-1]["after"]) for i in range(4))


def test_a_dropped_gossip_replica_sits_out_then_rejoins_with_the_live_replicas_state():
    live, dropped = (r.probe for r in runs()["dropped"])
    assert not all(torch.equal(live["sat_out"][n], t) for n, t in live["before"].items())  # replica 0 stepped
    for name, before in dropped["before"].items():
        assert torch.equal(dropped["sat_out"][name], before), name  # replica 1 ran nothing in step 2
        assert torch.equal(dropped["rejoined"][name], live["rejoined"][name]), name  # then took replica 0's
    assert all(loss is not None for loss in live["losses"])
    assert [loss is None for loss in dropped["losses"]] == [s in (2, 3) for s in range(8)]
