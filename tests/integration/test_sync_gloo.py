"""Replicas that step apart (`parallel.sync`) on real gloo ranks, without Ray, all plans in one spawned world:

- the exact checks: with an inner step linear in the gradient (`optimizer.kind: sgd`, with momentum, no
  clipping) local_sgd every=1, and diloco every=1 with outer_lr 1 and no momentum, equal all-reduce data
  parallelism within 1e-5 (averaging the replicas' parameters after a step is then averaging their gradients
  before it; AdamW is not linear, so there the three differ by design);
- the same with replicas of two dp ranks each (`parallel.sync.replicas`): at ZeRO-3 (a replica's ranks share its
  shards) and with MoE at ep=2 (they share its experts); tied embeddings at pp=2 over three replicas, the two
  copies bitwise equal after the syncs (in `make test-slow`);
- diloco every=4 at (dp=2, pp=2) with AdamW matches a reference computed in one process: two replicas as two
  one-rank trainers, each stepping on its share of the global batch, and the outer Nesterov step written out
  by hand (not torch's SGD, which `parallel.sync` uses): losses and final parameters within 1e-5;
- that run checkpoints after its first sync, and a run resumed from there (the outer momentum is in the
  checkpoint, the anchor is the parameters) follows it exactly.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import PlanRun, run_plans, stats_of
from helpers import SLOW_TESTS, slow, tiny_spec
from test_tied_gloo import assert_tied_equal, copies
from torch.distributed.tensor import DTensor
from trainyard.parallel.data.datasets import open_dataset
from trainyard.parallel.data.sampler import global_batch_ids, rank_share
from trainyard.parallel.io.checkpoint import step_dir
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec

STEPS, BATCH, EVERY, OUTER_LR, MOMENTUM = 8, 8, 4, 0.7, 0.9


def last_stage_losses(per_rank: list[list[dict]]) -> list[float]:
    """Each step's loss as the coordinator reports it: the mean of the replicas' last-stage losses (a local_sgd or
    diloco replica's is its own share's; with allreduce they are all the global batch's)."""
    per_replica = {stats[0]["dp_rank"]: stats for stats in per_rank if stats[0]["loss"] is not None}
    return [sum(stats[s]["loss"] for stats in per_replica.values()) / len(per_replica)
            for s in range(len(next(iter(per_replica.values()))))]

def plan_for(parallel: dict, sync: dict | None = None, global_batch: int = BATCH, steps: int = STEPS, **spec):
    par = {**parallel, **({"sync": sync} if sync else {})}
    return make_plan(parse_spec(tiny_spec(steps=steps, global_batch=global_batch, parallel=par, **spec)))


def final_params(driver, stats) -> dict[str, torch.Tensor]:
    """This rank's parameters, its local shards at tp > 1."""
    return {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for chunk in driver.trainer.chunks for name, p in chunk.named_parameters()}


def whole_params(driver, stats) -> dict[str, torch.Tensor]:
    """This rank's parameters whole: ZeRO-3's dim-0 shards gathered over the replica's ranks, by hand (DTensor's
    `full_tensor` caches its plans by mesh shape, which a later run of the shared world may meet with stale groups)."""
    out, group = {}, driver.trainer.groups.reduce
    for chunk in driver.trainer.chunks:
        for name, p in chunk.named_parameters():
            if isinstance(p, DTensor):
                shards: list = [None] * dist.get_world_size(group)
                dist.all_gather_object(shards, p.to_local().detach().clone(), group=group)
                out[name] = torch.cat(shards)
            else:
                out[name] = p.detach().clone()
    return out


def _state(driver) -> dict[str, torch.Tensor]:
    """A copy of this rank's whole state: parameters, inner moments, diloco's outer momentum."""
    trainer = driver.trainer
    kept = trainer.local_state()
    state = {f"model.{k}": t.clone() for k, t in kept["model"].items()}
    state |= {f"optim.{k}.{m}": t.clone() for k, v in kept["optim"].items() for m, t in v.items()}
    return state | {f"outer.{i}": t.clone() for i, t in enumerate(trainer.sync.momentum_buffers())}


def drop_and_rejoin(driver, stats) -> dict:
    """Replica 1 sits out steps 2 and 3 (as after a failure: `replica_sync.round_of`) and rejoins in step 3's sync
    (every=4); every step after is a whole round again. The state before, at and after the rejoin."""
    out = {"losses": []}
    for step in range(STEPS):
        if step == 2:
            out["before"] = _state(driver)
        taking_part = {2: {"live": (0,), "rejoining": ()}, 3: {"live": (0,), "rejoining": (1,)}}.get(step)
        out["losses"].append(driver.step(step, round_=taking_part).get("loss"))
        if step == 2:
            out["sat_out"] = _state(driver)
        if step == EVERY - 1:
            out["rejoined"] = _state(driver)
    return out


def stopped_between_syncs(root: str, driver, stats) -> dict:
    """A stop after step 6 of a diloco every=4 job (its rounds end after steps 4 and 8): the final checkpoint, as
    the coordinator takes it at the stop's boundary. This rank's state before and after it."""
    before = _state(driver)
    driver.final_checkpoint(Path(root), len(stats), {}, saved=False)
    coords = driver.trainer.coords
    return {"before": before, "after": _state(driver), "root": root, "dp": coords.dp, "tp": coords.tp}


def stopped_while_one_sat_out(root: str, driver, stats) -> dict:
    """Replica 1 sits out step 2 (as after a failure), then the job stops after it, between syncs: the final
    checkpoint, as the coordinator takes it with replica 0 alone live. This rank's state at the start, before
    the stop and after it."""
    out = {"start": _state(driver), "root": root}
    for step in range(3):
        driver.step(step, round_={"live": (0,), "rejoining": ()} if step == 2 else None)
    out["before"] = _state(driver)
    driver.final_checkpoint(Path(root), 3, {}, saved=False, live=(0,))
    return out | {"after": _state(driver)}


def two_replicas_by_hand(driver, stats) -> dict:
    """The reference: replicas 0 and 1 of a dp=2 job as two one-rank trainers (this plan has half the global
    batch, so each steps on its share's mean gradient), H local AdamW steps each, then the outer step; the job
    checkpoints at every sync, so the replicas also average their AdamW moments there, but for the last."""
    plan = driver.plan
    replicas = [driver.trainer_for(plan) for _ in range(2)]
    params = [[p for chunk in r.chunks for p in chunk.parameters()] for r in replicas]
    names = [name for chunk in replicas[0].chunks for name, _ in chunk.named_parameters()]
    anchor = [p.detach().clone() for p in params[0]]
    momentum = [torch.zeros_like(a) for a in anchor]
    num_samples, losses = open_dataset(plan.config).num_samples, []
    for step in range(STEPS):
        ids = global_batch_ids(plan.config.seed, step, BATCH, num_samples)
        step_losses = [r.train_step(step, rank_share(ids, i, 2, plan.microbatches)).loss
                       for i, r in enumerate(replicas)]
        losses.append(sum(step_losses) / 2)
        if (step + 1) % EVERY == 0:
            with torch.no_grad():
                views = [r.optimizer.export() for r in replicas]  # the moments, in the checkpoint's form
                for k in range(len(anchor) if step + 1 < STEPS else 0):
                    moments = [view.state[params[i][k]] for i, view in enumerate(views)]
                    for key in ("exp_avg", "exp_avg_sq"):
                        mean = (moments[0][key] + moments[1][key]) / 2
                        for m in moments:
                            m[key].copy_(mean)
                for view in views:
                    view.write_back()
                for k, a in enumerate(anchor):
                    delta = a - (params[0][k] + params[1][k]) / 2
                    momentum[k] = MOMENTUM * momentum[k] + delta
                    a -= OUTER_LR * (delta + MOMENTUM * momentum[k])  # Nesterov
                    for p in params:
                        p[k].copy_(a)
    return {"losses": losses, "params": dict(zip(names, anchor, strict=True))}


NO_CLIP = {"optimizer": {"kind": "sgd", "lr": 0.05, "grad_clip": 0.0, "warmup_steps": 2}}  # momentum 0.9
EXACT = {
    "allreduce": plan_for({"dp": 2}, **NO_CLIP),
    "local_sgd": plan_for({"dp": 2}, {"kind": "local_sgd", "every": 1}, **NO_CLIP),
    "diloco": plan_for({"dp": 2}, {"kind": "diloco", "every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}, **NO_CLIP),
    "allreduce-tp2": plan_for({"dp": 2, "tp": 2}, **NO_CLIP),
    "diloco-tp2": plan_for({"dp": 2, "tp": 2}, {"kind": "diloco", "every": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
                           **NO_CLIP),
}
EVERY_STEP = {"kind": "diloco", "every": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "replicas": 2}
MOE = {"n_layer": 2, "moe": {"experts": 4, "top_k": 2, "every": 2}}
SHARDED = {  # replicas of two dp ranks each, sharing ZeRO-3's shards or MoE's experts (ep=2), against all-reduce
    "diloco-zero3": (plan_for({"dp": 4, "zero": 3}, EVERY_STEP, **NO_CLIP), "allreduce"),
    "allreduce-moe": (plan_for({"dp": 2, "ep": 2}, steps=3, model=MOE, **NO_CLIP), None),
    "diloco-moe": (plan_for({"dp": 4, "ep": 2}, EVERY_STEP, steps=3, model=MOE, **NO_CLIP), "allreduce-moe"),
}
TIED = {"model": {"tie_embeddings": True, "n_layer": 2}, "global_batch": 6, "steps": 3, **NO_CLIP}
TIED_RUNS = {  # three replicas (a sum of more than two could round apart by its order in a buffer)
    "allreduce-tied": plan_for({"dp": 3, "pp": 2, "microbatches": 2}, **TIED),
    "diloco-tied": plan_for({"dp": 3, "pp": 2, "microbatches": 2}, {**EVERY_STEP, "replicas": 3}, **TIED),
}
DILOCO = {"kind": "diloco", "every": EVERY, "outer_lr": OUTER_LR, "outer_momentum": MOMENTUM}
SAVES = {"checkpoint": {"every": EVERY}}  # the syncs a checkpoint follows average the inner optimizer state too


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("checkpoints"))
    named = [(key, PlanRun(plan, probe=final_params)) for key, plan in EXACT.items()]
    named += [(key, PlanRun(plan, probe=whole_params)) for key, (plan, _) in SHARDED.items()]
    if SLOW_TESTS:  # two 6-rank runs: `make test-slow`
        named += [(key, PlanRun(plan, probe=copies)) for key, plan in TIED_RUNS.items()]
    named += [
        ("diloco-pp2", PlanRun(plan_for({"dp": 2, "pp": 2, "microbatches": 2}, DILOCO, **SAVES),
                               probe=final_params, save_after=(EVERY,), root=root)),
        ("resumed", PlanRun(plan_for({"dp": 2, "pp": 2, "microbatches": 2}, DILOCO, **SAVES),
                            resume=(str(step_dir(Path(root), EVERY)), EVERY))),
        ("dropped", PlanRun(plan_for({"dp": 2, "pp": 2, "microbatches": 2}, DILOCO), steps=range(0),
                            probe=drop_and_rejoin)),
        ("by-hand", PlanRun(plan_for({"microbatches": 2}, global_batch=BATCH // 2), steps=range(0),
                            probe=two_replicas_by_hand)),
    ]
    named += [(key, PlanRun(plan_for({"dp": 2}, DILOCO, optimizer={"offload": offload}), probe=final_params))
              for key, offload in (("diloco-dp2", False), ("diloco-dp2-offload", True))]
    stop_root = str(tmp_path_factory.mktemp("stopped"))
    named.append(("stopped", PlanRun(plan_for({"dp": 2, "tp": 2}, DILOCO), steps=range(6), root=stop_root,
                                     probe=partial(stopped_between_syncs, stop_root))))
    sat_out_root = str(tmp_path_factory.mktemp("stopped-sat-out"))
    named.append(("stopped-sat-out", PlanRun(plan_for({"dp": 2}, DILOCO), steps=range(0), root=sat_out_root,
                                             probe=partial(stopped_while_one_sat_out, sat_out_root))))
    results = run_plans([run for _, run in named])
    return {key: r for (key, _), r in zip(named, results, strict=True)}


@pytest.mark.parametrize("kind", ["local_sgd", "diloco", "diloco-tp2"])
def test_synchronising_every_step_equals_all_reduce_with_a_linear_inner_step(runs, kind):
    """Also at tp=2: a replica is a whole tp group, and diloco's anchor its local shards."""
    reference, local = runs["allreduce-tp2" if kind.endswith("tp2") else "allreduce"], runs[kind]
    np.testing.assert_allclose(last_stage_losses(stats_of(local)), last_stage_losses(stats_of(reference)), rtol=1e-5)
    for rank in range(len(reference)):
        for name, p in reference[rank].probe.items():
            torch.testing.assert_close(local[rank].probe[name], p, rtol=1e-5, atol=1e-6)
    # the replicas send their parameters once per step instead of their gradients: the same bytes, the last step's
    # too (the final checkpoint takes replica 0's momentum buffers, not their average)
    sent, reduced = ([s["cross_replica_bytes"] for s in run[0].stats] for run in (local, reference))
    assert sent == reduced


@pytest.mark.parametrize("kind", ["diloco-zero3", "diloco-moe"])
def test_replicas_of_sharded_ranks_synchronising_every_step_equal_all_reduce(runs, kind):
    """dp=4 as two replicas of two dp ranks (`parallel.sync.replicas: 2`): ZeRO-3 shards within a replica and the
    sync averages each shard over the replicas holding it; with MoE at ep=2 each replica holds every expert and
    the sync averages each expert over the replicas. Every step with a linear inner step: all-reduce's numbers."""
    local, reference = runs[kind], runs[SHARDED[kind][1]]
    np.testing.assert_allclose(last_stage_losses(stats_of(local)), last_stage_losses(stats_of(reference)), rtol=1e-5)
    plan = SHARDED[kind][0]
    for rank in range(len(local)):
        twin = reference[plan.coords(rank).dp % 2].probe  # dp2's rank with the same experts (ep index)
        for name, p in local[rank].probe.items():
            torch.testing.assert_close(p, twin[name], rtol=1e-5, atol=1e-6)


@slow
def test_tied_embeddings_across_stages_stay_bitwise_equal_through_the_syncs(runs):
    """The embedding (first stage) and its head copy (last stage) are averaged each in an all-reduce of its own
    over the three replicas: equal going in, equal coming out; every step with a linear inner step, as all-reduce."""
    local, reference = runs["diloco-tied"], runs["allreduce-tied"]
    np.testing.assert_allclose(last_stage_losses(stats_of(local)), last_stage_losses(stats_of(reference)), rtol=1e-5)
    assert_tied_equal(local)
    for mine, twin in zip(local, reference, strict=True):
        for key in ("embedding", "head"):
            if key in mine.probe:
                torch.testing.assert_close(mine.probe[key], twin.probe[key], rtol=1e-5, atol=1e-6)


def test_diloco_at_dp2_pp2_matches_two_replicas_and_the_outer_step_by_hand(runs):
    run, by_hand = runs["diloco-pp2"], runs["by-hand"][0].probe
    np.testing.assert_allclose(last_stage_losses(stats_of(run)), by_hand["losses"], rtol=1e-5)
    for rank in range(4):
        for name, p in run[rank].probe.items():
            if name.endswith("attn.k.bias"):
                # Its gradient is zero in exact arithmetic (a query's scores shift by one constant, which softmax
                # ignores); AdamW scales the rounding noise left in its place to full-size steps, so its values
                # depend on the order of float operations (they differed on an AMD EPYC, not on a Xeon).
                continue
            torch.testing.assert_close(p, by_hand["params"][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, rank=rank: f"{name} on rank {rank}: {m}")
    sent = [s["cross_replica_bytes"] for s in run[0].stats]
    assert [b > 0 for b in sent] == [False, False, False, True] * 2  # parameters cross only at the syncs
    first_stage_params = sum(p.numel() for p in run[0].probe.values())
    assert sent[EVERY - 1] == 3 * 4 * first_stage_params  # parameters and, a checkpoint following, two moments
    assert sent[-1] == 4 * first_stage_params  # the last step's: the parameters only


def test_an_offloaded_optimizer_steps_from_the_synchronised_parameters(runs):
    """Offloaded, the optimizer steps host copies of the parameters: a sync must reach them, or the next step
    undoes it. The losses and parameters equal those of the same diloco job not offloaded."""
    plain, offloaded = runs["diloco-dp2"], runs["diloco-dp2-offload"]
    np.testing.assert_allclose(last_stage_losses(stats_of(offloaded)), last_stage_losses(stats_of(plain)), rtol=1e-6)
    for rank in (0, 1):
        for name, p in plain[rank].probe.items():
            torch.testing.assert_close(offloaded[rank].probe[name], p, rtol=1e-5, atol=1e-5)


def test_a_diloco_run_resumed_from_its_checkpoint_follows_it_exactly(runs):
    original, resumed = last_stage_losses(stats_of(runs["diloco-pp2"])), last_stage_losses(stats_of(runs["resumed"]))
    assert resumed == original[EVERY:]


def test_a_dropped_replica_sits_out_then_takes_the_live_replicas_state_in_the_sync(runs):
    by_rank = [r.probe for r in runs["dropped"]]
    rank_of = plan_for({"dp": 2, "pp": 2, "microbatches": 2}, DILOCO).rank_of
    for pp in range(2):
        live, dropped = by_rank[rank_of(pp, 0, 0)], by_rank[rank_of(pp, 0, 1)]
        assert not all(torch.equal(live["sat_out"][n], t) for n, t in live["before"].items())  # replica 0 stepped
        for name, before in dropped["before"].items():
            assert torch.equal(dropped["sat_out"][name], before), name  # replica 1 ran nothing in step 2
            assert torch.equal(dropped["rejoined"][name], live["rejoined"][name]), name  # then took replica 0's
    live, dropped = by_rank[rank_of(1, 0, 0)]["losses"], by_rank[rank_of(1, 0, 1)]["losses"]
    assert all(loss is not None for loss in live)  # the live replica stepped throughout, the other did not
    assert [loss is None for loss in dropped] == [s in (2, 3) for s in range(STEPS)]


def saved_checkpoint(root: str, step: int, scratch: Path) -> dict:
    """Checkpoint `step` under `root`, whole (every tensor unsharded), as nested dicts: DCP's own conversion."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir(Path(root), step), scratch / "saved.pt")
    return torch.load(scratch / "saved.pt")


def test_a_stop_between_syncs_checkpoints_one_model_with_replica_0s_moments(runs, tmp_path):
    """At (dp=2, tp=2), with outer momentum: each replica a tp pair, compared shard by shard."""
    shard = {(r.probe["dp"], r.probe["tp"]): r.probe for r in runs["stopped"]}
    saved = saved_checkpoint(shard[0, 0]["root"], 6, tmp_path)
    for tp in (0, 1):
        zero, one = shard[0, tp], shard[1, tp]
        params = [k for k in zero["before"] if k.startswith("model.")]
        moments = [k for k in zero["before"] if k.startswith("optim.")]
        # they stepped apart (but for a shard no batch reaches: tp rank 1's half of the byte embedding, bytes >= 128)
        assert sum(not torch.equal(zero["before"][k], one["before"][k]) for k in params) >= len(params) - 1
        for k in params:  # the stop synchronised them (the outer step): one model
            torch.testing.assert_close(zero["after"][k], one["after"][k], rtol=0, atol=0)
        # their moments stay their own
        assert sum(not torch.equal(zero["after"][k], one["after"][k]) for k in moments) >= len(moments) - 2

    def whole(key: str) -> torch.Tensor:  # replica 0's tensor, its two tp shards put together
        parts, full = [shard[0, tp]["after"][key] for tp in (0, 1)], saved_value(key)
        if parts[0].shape == full.shape:
            return parts[0]
        return torch.cat(parts, dim=next(d for d in range(full.dim()) if parts[0].shape[d] != full.shape[d]))

    def saved_value(key: str) -> torch.Tensor:
        group, name = key.split(".", 1)
        return saved[group][name] if group == "model" else saved[group][name.rsplit(".", 1)[0]][name.rsplit(".", 1)[1]]

    for key in (k for k in shard[0, 0]["after"] if not k.startswith("outer.")):  # replica 0's parameters, moments
        assert torch.equal(saved_value(key), whole(key)), key
    assert "sync" in saved  # and diloco's outer momentum


def test_a_stop_while_a_replica_sits_out_syncs_the_live_ones_and_the_other_takes_their_state(runs, tmp_path):
    zero, one = (r.probe for r in runs["stopped-sat-out"])
    params = [k for k in zero["before"] if k.startswith("model.")]
    for k in params:
        # the outer step over replica 0 alone, the first (zero momentum): anchor - lr (1 + momentum) delta
        delta = zero["start"][k] - zero["before"][k]
        torch.testing.assert_close(zero["after"][k], zero["start"][k] - OUTER_LR * (1 + MOMENTUM) * delta)
    assert not any(torch.equal(zero["before"][k], one["before"][k]) for k in params)  # replica 1 missed step 2
    saved = saved_checkpoint(zero["root"], 3, tmp_path)
    for k, t in zero["after"].items():  # replica 1 took all of replica 0's state, which the checkpoint holds
        assert torch.equal(one["after"][k], t), k
    for k in params:
        assert torch.equal(saved["model"][k.removeprefix("model.")], zero["after"][k]), k
