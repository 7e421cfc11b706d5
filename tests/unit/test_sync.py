"""`parallel.sync`'s pure rules: when replicas synchronise, the bytes they send, and the combinations the plan
refuses (422, naming the field and the rule). The numerics run on gloo: tests/integration/test_sync_gloo.py."""

from __future__ import annotations

import pytest
from helpers import tiny_spec
from trainyard.parallel.config import SyncConfig
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.plan.present import describe
from trainyard.parallel.plan.sync.replica_sync import (
    averages_optimizer_state,
    cross_replica_bytes,
    syncs_after,
    syncs_before_save,
    whole_sync,
)
from trainyard.parallel.spec import parse_spec


def test_replicas_synchronise_every_h_steps_and_after_the_last():
    cfg = SyncConfig(kind="diloco", every=4)
    assert [s for s in range(10) if syncs_after(s, cfg, steps=10)] == [3, 7, 9]
    assert not any(syncs_after(s, SyncConfig(), steps=10) for s in range(10))  # allreduce syncs gradients


def test_only_the_syncs_a_scheduled_checkpoint_follows_average_the_moments_and_a_stop_between_syncs_syncs():
    cfg = SyncConfig(kind="diloco", every=4)
    # checkpoint.every 8 over 16 steps: after step 8 (a resumed run must follow the uninterrupted one), not after
    # the last, whose checkpoint continues no run exactly and takes replica 0's moments
    assert [s for s in range(16) if averages_optimizer_state(s, cfg, 8, steps=16)] == [7]
    assert not any(averages_optimizer_state(s, cfg, 0, steps=16) for s in range(16))
    assert [n for n in range(17) if syncs_before_save(n, cfg, steps=16)] == [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15]
    assert not any(syncs_before_save(n, SyncConfig(), steps=16) for n in range(17))


def test_local_replicas_send_the_parameters_once_per_h_steps():
    allreduce = cross_replica_bytes(SyncConfig(), 1000, dp=4)
    assert allreduce == 4000 and cross_replica_bytes(SyncConfig(), 1000, dp=4, wire_bytes=2) == 2000
    assert cross_replica_bytes(SyncConfig(kind="local_sgd", every=8), 1000, dp=4) == allreduce / 8
    assert cross_replica_bytes(SyncConfig(kind="diloco", every=8), 1000, dp=1) == 0


def test_gossip_sends_to_each_peer_and_only_its_last_and_checkpointed_syncs_are_whole():
    cfg = SyncConfig(kind="gossip", every=2, peers=3)
    assert cross_replica_bytes(cfg, 1000, dp=8) == 4 * 1000 * 3 / 2
    assert [s for s in range(10) if syncs_after(s, cfg, steps=10)] == [1, 3, 5, 7, 9]
    assert [s for s in range(10) if whole_sync(s, cfg, 4, steps=10)] == [3, 7, 9]  # checkpoints at 4, 8; the last
    assert all(whole_sync(s, SyncConfig(kind="local_sgd", every=2), 0, steps=10) for s in range(10))


def test_the_plan_shows_the_bytes_per_step_of_each_stage():
    def sync_of(sync):
        spec = tiny_spec(model={"n_layer": 4}, parallel={"dp": 2, "pp": 2, "microbatches": 2, "sync": sync})
        return describe(make_plan(parse_spec(spec)))["sync"]

    allreduce, diloco = sync_of({}), sync_of({"kind": "diloco", "every": 8})
    gossip = sync_of({"kind": "gossip", "every": 4, "peers": 1, "topology": "random"})
    assert (gossip["peers"], gossip["topology"]) == (1, "random")  # its options shown
    assert gossip["cross_replica_bytes_per_step"] == [b / 4 for b in allreduce["cross_replica_bytes_per_step"]]
    assert diloco["kind"] == "diloco" and diloco["every"] == 8 and len(diloco["cross_replica_bytes_per_step"]) == 2
    assert diloco["cross_replica_bytes_per_step"] == [b / 8 for b in allreduce["cross_replica_bytes_per_step"]]


@pytest.mark.parametrize(("overrides", "field", "words"), [
    ({"parallel": {"dp": 2, "zero": 1, "sync": {"kind": "local_sgd", "every": 4}}}, "parallel.sync.replicas",
     "parallel.zero=1 shards the state over the data-parallel ranks of a replica"),
    ({"model": {"n_layer": 2, "moe": {"experts": 2, "top_k": 1, "every": 2}},
      "parallel": {"dp": 2, "ep": 2, "sync": {"kind": "diloco", "every": 4}}}, "parallel.sync.replicas",
     "ep=2 does not divide the 1 data-parallel ranks of each diloco replica"),
    ({"parallel": {"dp": 4, "sync": {"kind": "diloco", "replicas": 3}}}, "parallel.sync.replicas",
     "replicas=3 does not divide dp=4"),
    ({"parallel": {"dp": 4, "sync": {"replicas": 2}}}, "parallel.sync.replicas", "only local_sgd, diloco and gossip"),
    ({"parallel": {"dp": 2, "sync": {"kind": "diloco", "every": 4}}, "checkpoint": {"every": 6}, "steps": 8},
     "checkpoint.every", "multiple of parallel.sync.every=4"),
    ({"parallel": {"dp": {"min": 1, "max": 2}, "sync": {"kind": "local_sgd", "every": 4}}}, "parallel.sync",
     "elastic"),
    ({"parallel": {"dp": 2, "sync": {"kind": "diloco", "every": 4},
                   "grad_compression": {"kind": "powersgd", "rank": 2}}}, "parallel.grad_compression", "diloco"),
    ({"parallel": {"dp": 4, "sync": {"kind": "gossip", "peers": 4}}}, "parallel.sync.peers",
     "peers=4 needs at least 5 replicas, and there are 4"),
    ({"parallel": {"dp": 4, "sync": {"kind": "gossip", "peers": 1, "replicas": 1}}},
     "parallel.sync.peers", "peers=1 needs at least 2 replicas, and there are 1"),
    ({"parallel": {"dp": 3, "sync": {"kind": "gossip", "peers": 1}}, "global_batch": 6}, "parallel.sync.peers",
     "an odd number of peers pairs an even number of replicas only"),
], ids=["zero1-one-rank-replicas", "moe-ep2-one-rank-replicas", "replicas-not-dividing-dp", "allreduce-replicas",
        "checkpoint-mid-round", "elastic", "grad-compression", "gossip-too-many-peers", "gossip-one-replica",
        "gossip-odd-pairing"])
def test_combinations_that_do_not_compose_are_refused_naming_the_field(overrides, field, words):
    with pytest.raises(PlanError) as info:
        make_plan(parse_spec(tiny_spec(**overrides)))
    assert info.value.field == field and words in str(info.value)


def test_replicas_of_several_dp_ranks_reduce_shard_and_spread_experts_within_the_replica():
    """dp=4 as two diloco replicas of two dp ranks: gradients, ZeRO's shards and MoE's experts (ep=2) stay within a
    replica; a sync averages each rank's shard with the rank at the same place in the other replica."""
    moe = {"n_layer": 2, "moe": {"experts": 4, "top_k": 2, "every": 2}}
    plan = make_plan(parse_spec(tiny_spec(model=moe, parallel={"dp": 4, "ep": 2, "zero": 3,
                                                               "sync": {"kind": "diloco", "replicas": 2}})))
    assert plan.reduce_dp == 2
    assert plan.dp_groups() == [[0, 1], [2, 3]] and plan.cross_replica_groups() == [[0, 2], [1, 3]]
    assert plan.expert_groups() == [[0], [1], [2], [3]] and plan.stage_groups() == [[0, 1], [2, 3]]
    assert plan.experts_of(0) == plan.experts_of(2) != plan.experts_of(1)
    # ZeRO-3's shards are halves (a replica's two ranks), not all-reduce's quarters
    quarters = make_plan(parse_spec(tiny_spec(model=moe, parallel={"dp": 4, "ep": 2, "zero": 3})))
    assert plan.memory()[0].optimizer > quarters.memory()[0].optimizer
    # MoE at ep=1 composes with one-rank replicas (each holds every expert)
    assert make_plan(parse_spec(tiny_spec(model=moe, parallel={"dp": 2, "sync": {"kind": "local_sgd"}}))).reduce_dp == 1


@pytest.mark.parametrize("every", [8, 10, 10**9])
def test_a_checkpoint_interval_of_the_steps_or_more_need_not_divide_by_the_sync_interval(every):
    """Such a job saves only its final checkpoint, after the last step's sync (it was refused as a checkpoint
    between syncs); one interval shorter than the job still is."""
    sync = {"dp": 2, "sync": {"kind": "diloco", "every": 3}}
    plan = make_plan(parse_spec(tiny_spec(steps=8, checkpoint={"every": every}, parallel=sync)))
    assert plan.config.checkpoint.every == every
    with pytest.raises(PlanError, match="checkpoint.every=7 is not a multiple of parallel.sync.every=3"):
        make_plan(parse_spec(tiny_spec(steps=8, checkpoint={"every": 7}, parallel=sync)))


def test_a_checkpoint_says_whether_it_holds_the_outer_momentum(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from trainyard.parallel.runtime.sync import saved_outer_state

    weights = {"h.0.w": torch.ones(2)}
    dcp.save({"model": weights}, checkpoint_id=tmp_path / "allreduce", no_dist=True)
    dcp.save({"model": weights, "sync": {"h.0.w": torch.zeros(2)}}, checkpoint_id=tmp_path / "diloco", no_dist=True)
    assert not saved_outer_state(tmp_path / "allreduce") and saved_outer_state(tmp_path / "diloco")


def test_the_runtime_registry_and_the_plans_table_name_the_same_modes():
    """A mode is a `parallel.runtime.sync.SYNCS` entry (how it runs; None: the reducers' all-reduce) and a
    `parallel.plan.sync.replica_sync.SYNC_KINDS` entry (its pure facts): the two, and the spec's kinds, agree; the
    registry's names are read without torch."""
    import subprocess
    import sys
    from pathlib import Path
    from typing import get_args, get_type_hints

    from trainyard.parallel.plan.sync.replica_sync import NAMES as PLAN_NAMES
    from trainyard.parallel.plan.sync.replica_sync import SYNC_KINDS
    from trainyard.parallel.runtime.sync import NAMES, SYNCS

    assert NAMES == PLAN_NAMES and set(get_args(get_type_hints(SyncConfig)["kind"])) == set(NAMES)
    assert {name for name, factory in SYNCS.items() if factory is not None} == {
        name for name, kind in SYNC_KINDS.items() if kind.steps_apart}
    code = "import sys, trainyard.parallel.runtime.sync; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout == "False\n"
