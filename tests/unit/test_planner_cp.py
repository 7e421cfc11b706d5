"""The planner searches context parallelism: cp where the rules let the model take it, the ring's exchanges charged
by the cost model and a rank's compute split over the group, cp > 1 chosen where a long sequence fits no other way or
runs faster, cp 1 kept on short sequences, and the answer saying where cp lost or why it was not tried."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_planner import CALIBRATED_2_CORES, cpu_cluster, machine
from trainyard.parallel.config import JobConfig, ModelConfig, MoEConfig, ParallelConfig, SyncConfig
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.admission import ClusterResources, NodeResources
from trainyard.parallel.plan.planner.cost_model import step_costs
from trainyard.parallel.plan.planner.machine_costs import Fit
from trainyard.parallel.plan.planner.planner import choose, plan_layouts
from trainyard.parallel.plan.planner.planner_search import cp_degrees
from trainyard.parallel.plan.reduction_sets import group_sizes
from trainyard.parallel.plan.rules import PlanError, violations

MiB = 2**20


def llama(seq_len: int, **over) -> ModelConfig:
    return ModelConfig(**{"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64,
                          "ffn_hidden": 128, "vocab_size": 256, "seq_len": seq_len, **over})


def one_cpu_nodes(n: int, memory: float) -> ClusterResources:
    """n nodes of one core each: no tp group fits a node, and every rank may hold the node's `memory`."""
    return ClusterResources(nodes=(NodeResources(cpus=1, gpus=0, memory=memory),) * n)


def degrees(result) -> list[tuple[int, int, int, int]]:
    return [(c.config.parallel.dp, c.config.parallel.cp, c.config.parallel.pp, c.config.parallel.tp)
            for c in result.candidates]


def test_a_long_sequence_that_fits_only_with_cp_is_given_cp_and_make_plan_admits_it():
    """One 4096-token sequence a step on four one-core nodes, with a ring too dear to pay for itself: roomy nodes run
    it on one rank; nodes too small for any cp 1 layout (full recompute, ZeRO-3 and offload included) get cp."""
    job = JobConfig(model=llama(4096), steps=1, global_batch=1)
    dear_ring = machine(matmul=Fit(0.0, 1e12), p2p=Fit(1.0, 1e6))
    roomy = plan_layouts(job, one_cpu_nodes(4, 64 * MiB), dear_ring)
    assert degrees(roomy)[0] == (1, 1, 1, 1)
    tight = one_cpu_nodes(4, 9 * MiB)
    result = plan_layouts(job, tight, dear_ring)
    assert all(cp > 1 for _, cp, _, _ in degrees(result))
    assert result.best.terms["cp ring"] > result.best.terms["compute"]  # chosen for its memory, not its speed
    chosen, _ = choose(replace(job, parallel="auto"), tight, dear_ring)
    assert chosen.parallel.cp > 1 and chosen.planned.chosen_automatically
    plan = make_plan(chosen, tight)
    assert plan.world_size == chosen.parallel.cp and plan.cp_groups() == [list(range(chosen.parallel.cp))]
    assert max(r.total for r in plan.memory()) <= 9 * MiB


def test_a_long_sequence_the_ring_cannot_split_is_refused_naming_the_rule_that_kept_cp_at_1():
    gpt2 = JobConfig(model=llama(4096, family="gpt2", n_kv_head=None, ffn_hidden=None), steps=1, global_batch=1)
    with pytest.raises(PlanError) as e:
        plan_layouts(gpt2, one_cpu_nodes(4, 9 * MiB), machine())
    assert e.value.field == "parallel"
    assert "cp=1" in e.value.message and "parallel.cp at 1 only (cp=2 with model.family=gpt2" in e.value.message


def test_cp_is_tried_where_the_rules_allow_it_and_the_result_says_which():
    assert cp_degrees(JobConfig(model=llama(64), steps=1), 64) == [1, 2, 4, 8, 16, 32]  # 2 x cp divides 64
    assert cp_degrees(JobConfig(model=llama(48), steps=1), 8) == [1, 2, 3, 4, 6, 8]
    refused = [JobConfig(model=llama(64, moe=MoEConfig(experts=2, top_k=1)), steps=1),
               JobConfig(model=llama(64), steps=1, compile=True),
               JobConfig(model=llama(64), steps=1, global_batch=2,
                         parallel=ParallelConfig(dp=2, sync=SyncConfig(kind="diloco", every=2))),
               JobConfig(model=ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=64), steps=1)]  # gpt2
    for job in refused:
        assert cp_degrees(job, 8) == [1], job
    short = plan_layouts(JobConfig(model=llama(32), steps=1, global_batch=4), cpu_cluster(cpus=4), machine())
    assert "cp in [1, 2, 4]" in short.bounds
    gpt2 = plan_layouts(JobConfig(model=ModelConfig(n_layer=2, n_head=4, d_model=64, seq_len=32), steps=1,
                                  global_batch=4), cpu_cluster(cpus=4), machine())
    assert "cp in [1] (cp=2 with model.family=gpt2" in gpt2.bounds
    for cand in short.candidates:
        assert violations(cand.config) == [] and "cp" in cand.to_dict()["layout"]


@pytest.mark.parametrize(("seq_len", "batch"), [(32, 1), (128, 1), (128, 8)])
def test_on_short_sequences_cp_1_keeps_winning_and_a_cp_runner_up_loses_on_its_ring(seq_len, batch):
    """This VM's calibrated costs: a short sequence's ring costs more than its split saves, and with sequences to
    spare dp splits them without one."""
    job = JobConfig(model=llama(seq_len, n_layer=4, n_head=8, n_kv_head=4, d_model=128, vocab_size=512), steps=1,
                    global_batch=batch)
    result = plan_layouts(job, cpu_cluster(cpus=4), CALIBRATED_2_CORES, top=8)
    assert result.best.config.parallel.cp == 1
    if batch > 1:
        ring_lost = [c.reason for c in result.candidates if c.config.parallel.cp > 1]
        assert ring_lost and all(r.startswith("cp ring ") for r in ring_lost), ring_lost


def test_a_long_sequence_with_no_batch_to_split_runs_faster_at_cp_by_the_cost_model():
    job = JobConfig(model=llama(1024, n_layer=4, n_head=8, n_kv_head=4, d_model=128, vocab_size=512), steps=1,
                    global_batch=1)
    cluster = cpu_cluster(cpus=4, memory=2**33)
    result = plan_layouts(job, cluster, CALIBRATED_2_CORES, top=10**6)
    assert result.best.config.parallel.cp > 1
    one_rank = next(c for c, d in zip(result.candidates, degrees(result), strict=True) if d == (1, 1, 1, 1))
    assert one_rank.reason.startswith("compute ")  # cp=1 loses on the compute cp splits over the group
    assert make_plan(result.best.config, cluster).cp == result.best.config.parallel.cp


def test_the_cost_model_splits_the_compute_over_cp_and_charges_the_ring_each_block_each_way():
    job = JobConfig(model=llama(64), steps=1, global_batch=2)
    at = {cp: replace(job, parallel=replace(job.parallel, cp=cp)) for cp in (1, 2)}
    free = machine()
    one, two = (step_costs(make_plan(c).layout, c, free) for c in at.values())
    assert two.compute_per_chunk == pytest.approx(one.compute_per_chunk / 2)  # half the tokens, attention included
    assert one.cp_per_chunk == 0.0 and two.cp_per_chunk > 0.0
    # two ranks sharing one node's cores: nothing hides the ring behind the attention
    shared = replace(machine(p2p=Fit(1e-3, 1e8), allreduce=Fit(1e-3, 1e8)), contention=(1.0, 1.5))
    hop = 1e-3 + 2 * 4 * 64 * 2 * 16 / 1e8  # k and v, fp32, of a rank's 2 x 64 / 2 tokens, 2 kv heads of 16
    ring = step_costs(make_plan(at[2]).layout, at[2], shared)
    blocks = 2  # forward: cp - 1 blocks passed on; backward: as many, and cp shifts of the dK/dV accumulators
    assert ring.cp_per_chunk == pytest.approx(blocks * ((2 - 1) * hop + ((2 - 1) + 2) * hop))
    full = replace(at[2], activation_checkpointing="full")  # recompute re-runs the forward's ring in backward
    assert step_costs(make_plan(full).layout, full, shared).cp_per_chunk == pytest.approx(ring.cp_per_chunk + 2 * hop)
    assert ring.dp_exposed > 0.0  # the cp ranks sum their gradients: dp x cp = 2 reduce, with dp = 1


def test_the_gradients_and_zero_shards_are_counted_over_dp_x_cp_as_the_runtime_groups_them():
    job = JobConfig(model=llama(64), steps=1, global_batch=2)
    cp2 = make_plan(replace(job, parallel=replace(job.parallel, cp=2, zero=1)))
    cp1 = make_plan(replace(job, parallel=replace(job.parallel, zero=1)))
    assert group_sizes(cp2.layout)["dense"] == len(cp2.dp_groups()[0]) == 2
    assert cp2.memory()[0].optimizer == pytest.approx(cp1.memory()[0].optimizer / 2, rel=1e-3)


def test_at_scale_a_128k_token_llama_is_given_cp_and_says_its_bounds():
    from trainyard.parallel.plan.planner.device_plan import device_cluster
    from trainyard.parallel.plan.planner.device_profile import load_profile

    profile = load_profile("h100-sxm")
    model = ModelConfig(family="llama", n_layer=4, n_head=32, n_kv_head=8, d_model=4096, ffn_hidden=14336,
                        vocab_size=32000, seq_len=131072)
    job = JobConfig(model=model, steps=1, global_batch=16, precision="bf16")
    cluster = device_cluster(16, 8, profile)
    result = plan_layouts(job, cluster, profile.machine_costs())
    best = result.best.config.parallel
    assert best.cp > 1 and best.dp * best.cp * best.pp * best.tp == 128
    assert "as many more at cp > 1" in result.bounds and "one sequence" in result.bounds
    assert result.best.memory_bytes <= 0.9 * profile.hbm_bytes
    assert make_plan(result.best.config, cluster).world_size == 128


@pytest.mark.parametrize(("seq_len", "batch", "cpus"), [(512, 2, 8), (1024, 1, 4), (2048, 2, 8)])
def test_the_best_first_search_with_cp_finds_the_top_five_of_every_layout_timed(monkeypatch, seq_len, batch, cpus):
    """The cp layouts' bounds (their share of the FLOPs, the ring's dK/dV shifts that nothing hides, the gradients
    over dp x cp) stay below their predictions: none that would rank is pruned."""
    import trainyard.parallel.plan.planner.search_options as options

    monkeypatch.setattr(options, "SEARCHED", {"parallel.zero": lambda: (0,)})  # the layouts only
    job = JobConfig(model=llama(seq_len, n_layer=4, n_head=8, n_kv_head=4, d_model=128, vocab_size=512), steps=1,
                    global_batch=batch)
    cluster = cpu_cluster(cpus=cpus, memory=2**36)
    found = plan_layouts(job, cluster, CALIBRATED_2_CORES).candidates
    every = plan_layouts(job, cluster, CALIBRATED_2_CORES, top=10**6).candidates
    assert [c.step_s for c in found] == [c.step_s for c in every[:5]]
    assert any(c.config.parallel.cp > 1 for c in every[:5])
