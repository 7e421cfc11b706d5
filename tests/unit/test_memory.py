"""The memory plan: exact parameter counts, the optimizer under ZeRO-1, activations under checkpointing and
the schedule, and the refusal of a job whose ranks cannot fit."""

import pytest
from helpers import tiny_spec
from trainyard.cli.offline import format_plan
from trainyard.parallel.models import family_of
from trainyard.parallel.models.whole import GPTStage
from trainyard.parallel.plan import ClusterResources, NodeResources, PlanError, make_plan
from trainyard.parallel.plan.memory.estimate import estimate, param_counts, peak_activation_bytes
from trainyard.parallel.plan.present import describe
from trainyard.parallel.plan.schedule.actions import virtual_stage
from trainyard.parallel.plan.units import format_bytes
from trainyard.parallel.spec import parse_spec
from trainyard.service.ray_runtime import gpu_memory

MOE = {"experts": 4, "top_k": 2, "every": 2}
GIB = 2**30


def plan_for(**overrides):
    model = {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 32, **overrides.pop("model", {})}
    return make_plan(parse_spec(tiny_spec(**{"model": model, "global_batch": 8, **overrides})))


def real_numel(plan, rank: int) -> int:
    """Parameters of the GPTStages the rank builds (tp = 1: the whole tensors), tied ones once."""
    pp = plan.coords(rank).pp
    params = {}
    for c, layers in enumerate(plan.chunk_layers(pp)):
        v = virtual_stage(pp, c, plan.pp, plan.placement)
        stage = GPTStage(plan.config.model, layers, first=v == 0, last=v == plan.n_virtual_stages - 1, seed=0,
                         experts=plan.experts_of(rank))
        params |= {id(p): p.numel() for p in stage.parameters()}
    return sum(params.values())


@pytest.mark.parametrize("overrides", [
    {},
    {"model": {"tie_embeddings": True, "context_len": 48}},
    {"parallel": {"pp": 2, "vpp": 2, "microbatches": 2, "schedule": "interleaved-1f1b"}},
    {"model": {"moe": MOE}, "parallel": {"dp": 2, "ep": 2, "pp": 2}},
    {"model": {"moe": {**MOE, "every": 1}}},
    {"parallel": {"pp": 2, "vpp": 2, "microbatches": 2, "schedule": "zbv"}},  # rank 0: first and last stage
    {"model": {"tie_embeddings": True}, "parallel": {"pp": 2}},  # the last stage's own copy of the embedding
    {"model": {"tie_embeddings": True}, "parallel": {"pp": 2, "vpp": 2, "microbatches": 2, "schedule": "zbv"}},
], ids=["dense", "tied", "pp2-vpp2", "moe-ep2-pp2", "moe-every-block", "pp2-zbv", "tied-pp2", "tied-pp2-zbv"])
def test_parameter_counts_equal_the_real_stages(overrides):
    plan = plan_for(**overrides)
    for rank in range(plan.world_size):
        assert param_counts(plan, plan.coords(rank).pp).total == real_numel(plan, rank), rank


def test_a_tied_embedding_across_stages_counts_its_head_copy_on_the_last_stage():
    tied, untied = plan_for(model={"tie_embeddings": True}, parallel={"pp": 2}), plan_for(parallel={"pp": 2})
    whole = param_counts(plan_for(model={"tie_embeddings": True}), 0).total  # pp=1: one tensor for both
    assert [param_counts(tied, pp).total for pp in (0, 1)] == [param_counts(untied, pp).total for pp in (0, 1)]
    assert param_counts(tied, 0).total + param_counts(tied, 1).total == whole + 256 * 64  # + the copy (vocab x d)
    assert tied.memory()[1].params == untied.memory()[1].params


def test_tensor_parallel_shards_the_dense_layers_but_not_the_experts():
    one, two = plan_for(model={"moe": MOE}), plan_for(model={"moe": MOE}, parallel={"tp": 2})
    a, b = param_counts(one, 0), param_counts(two, 0)
    assert (b.router, b.experts) == (a.router, a.experts)
    d, vocab, context = 64, 256, 32
    # replicated: wpe, the norms (two per block, ln_f) and the row-parallel layers' biases (attn.proj of the 4
    # blocks, mlp.proj of the 2 dense ones)
    replicated = context * d + (4 * 2 + 1) * 2 * d + (4 + 2) * d
    assert a.dense - replicated == 2 * (b.dense - replicated)
    assert a.dense > 2 * vocab * d  # the embedding and the head are part of what is split


def test_zero1_keeps_the_optimizer_state_of_half_the_parameters_at_dp2():
    plan = plan_for(model={"moe": MOE}, parallel={"dp": 2, "ep": 2})
    zero = plan_for(model={"moe": MOE}, parallel={"dp": 2, "ep": 2, "zero": 1})
    counts = param_counts(plan, 0)
    before, after = plan.memory()[0], zero.memory()[0]
    assert before.optimizer == 8 * counts.total
    # dense parameters over dp=2, the router over the stage's 2 ranks, experts over dp / ep = 1 rank
    assert after.optimizer == 8 * (counts.dense // 2 + counts.router // 2 + counts.experts)
    assert (after.params, after.activations) == (before.params, before.activations)
    assert after.grads == before.grads + 4 * (counts.dense // 2 + counts.router // 2)  # the reduced slices

    dense, dense_zero = plan_for(parallel={"dp": 2}), plan_for(parallel={"dp": 2, "zero": 1})
    assert dense_zero.memory()[0].optimizer * 2 == pytest.approx(dense.memory()[0].optimizer, abs=16)


def unit_params(plan, *, layers=(), first=False, last=False) -> int:
    """Local parameters of one FSDP2 unit (a block, the embedding, the head), by the model's family."""
    return family_of(plan.config.model).param_counts(plan.config.model, layers, first=first, last=last, tp=plan.tp,
                                                     ep=plan.ep).total


def test_zero2_and_zero3_keep_a_quarter_at_dp4_zero2_gathers_the_chunk_and_zero3_two_blocks():
    base = plan_for(parallel={"dp": 4}).memory()[0]
    plan2, plan3 = (plan_for(parallel={"dp": 4, "zero": z}) for z in (2, 3))
    zero2, zero3 = plan2.memory()[0], plan3.memory()[0]
    for z in (zero2, zero3):
        assert z.grads == pytest.approx(base.grads / 4, abs=16)
        assert z.optimizer == pytest.approx(base.optimizer / 4, abs=32)
    assert zero2.params == pytest.approx(base.params * 5 / 4, abs=16)  # the shard and the one chunk, whole
    assert zero2.gathered == base.params
    # per block: the block computing and the next one's gather (a block outweighs the embedding and the head)
    block = 4 * unit_params(plan3, layers=(0,))
    assert block > 4 * max(unit_params(plan3, first=True), unit_params(plan3, last=True))
    assert zero3.gathered == 2 * block and zero3.params == pytest.approx(base.params / 4 + 2 * block, abs=16)
    text = format_plan(describe(plan3))
    assert "parallel.zero: 3 (FSDP2): params are the 1/N shard" in text and "per block" in text
    assert f"at most {format_bytes(2 * block)} gathered at once" in text


def test_zero2_and_zero3_count_the_largest_unit_s_whole_gradient_in_the_step_s_peak():
    """The backward of the largest unit holds its gradient whole until its reduce-scatter: a block here, the head at
    a real vocabulary; zero 0 and 1 reduce from buckets the gradients count already."""
    base = plan_for(parallel={"dp": 4}).memory()[0]
    assert base.reduction == 0 and plan_for(parallel={"dp": 4, "zero": 1}).memory()[0].reduction == 0
    plan3 = plan_for(parallel={"dp": 4, "zero": 3})
    block = 4 * unit_params(plan3, layers=(0,))
    for z in (2, 3):
        m = plan_for(parallel={"dp": 4, "zero": z}).memory()[0]
        assert m.reduction == block and m.total == m.params + m.grads + m.optimizer + m.activations + block + m.loss
    headers = [next(line for line in format_plan(describe(p)).splitlines() if " optimizer " in line)
               for p in (plan3, plan_for())]
    assert " reduction " in headers[0] and " reduction " not in headers[1]  # a column at ZeRO-2/3 only
    wide = plan_for(model={"vocab_size": 4096}, parallel={"dp": 4, "zero": 3})  # tied: the embedding is the head
    embedding = 4 * unit_params(wide, first=True)
    assert wide.memory()[0].reduction == embedding > 4 * unit_params(wide, layers=(0,))


def test_zero3_counts_the_pair_that_crosses_from_one_compute_to_the_next():
    """A large vocabulary: the embedding and the head outweigh a block. 1f1b at pp=1 runs F B F B: a forward's
    last unit (the head) is the backward's first, and a backward's last (the embedding) the forward's first, so
    the peak is the embedding and the block after it; gpipe runs F F B B: the head computes while the next
    forward's embedding is gathered."""
    model = {"vocab_size": 4096}
    one_f_one_b = plan_for(model=model, parallel={"dp": 2, "zero": 3, "microbatches": 2})
    gpipe = plan_for(model=model, parallel={"dp": 2, "zero": 3, "microbatches": 2, "schedule": "gpipe"})
    embedding, head = unit_params(gpipe, first=True), unit_params(gpipe, last=True)
    block = unit_params(gpipe, layers=(0,))
    assert block < head < embedding
    assert one_f_one_b.memory()[0].gathered == 4 * (embedding + block)
    assert gpipe.memory()[0].gathered == 4 * (embedding + head)


def test_zero3_holds_a_tied_embedding_from_the_forward_s_first_unit_to_its_last():
    """Tied embeddings make the embedding and the head one unit, which FSDP2 frees after its second run."""
    plan = plan_for(model={"tie_embeddings": True}, parallel={"dp": 2, "zero": 3})
    tied, block = unit_params(plan, first=True, last=True), unit_params(plan, layers=(0,))
    assert plan.memory()[0].gathered == 4 * (tied + 2 * block)


def test_zero3_gathers_per_block_across_the_chunks_of_an_interleaved_rank():
    layout = {"dp": 2, "pp": 2, "vpp": 2, "microbatches": 2, "schedule": "interleaved-1f1b"}
    plan = plan_for(model={"n_layer": 8}, parallel={**layout, "zero": 3})
    whole = plan_for(model={"n_layer": 8}, parallel=layout).memory()[0]
    zero2 = plan_for(model={"n_layer": 8}, parallel={**layout, "zero": 2}).memory()[0]
    assert zero2.gathered == whole.params  # both chunks whole all step
    assert plan.memory()[0].gathered == 4 * 2 * unit_params(plan, layers=(0,))  # two blocks of four


def test_zero2_refuses_overlap_reduce_false_naming_the_field():
    with pytest.raises(PlanError) as info:
        plan_for(parallel={"dp": 2, "zero": 2, "overlap_reduce": False})
    assert info.value.field == "parallel.overlap_reduce" and "zero=2" in info.value.message


def test_a_bf16_reduction_adds_its_wire_copies_to_the_gradients():
    fp32, bf16 = plan_for(parallel={"dp": 2}), plan_for(parallel={"dp": 2, "reduce_dtype": "bf16"})
    assert bf16.memory()[0].grads == fp32.memory()[0].grads * 3 // 2
    alone = plan_for(parallel={"reduce_dtype": "bf16"})
    assert alone.memory()[0].grads == plan_for().memory()[0].grads  # dp=1: nothing goes on the wire


@pytest.mark.parametrize("overrides", [{}, {"precision": "bf16"}, {"model": {"moe": MOE}}], ids=["fp32", "bf16", "moe"])
def test_activation_checkpointing_lowers_the_activation_estimate(overrides):
    by_mode = {mode: plan_for(activation_checkpointing=mode, **overrides).memory()[0]
               for mode in ("none", "selective", "full")}
    assert by_mode["full"].activations < by_mode["selective"].activations < by_mode["none"].activations
    assert by_mode["none"].recompute == 0 < by_mode["selective"].recompute < by_mode["full"].recompute
    assert by_mode["full"].total < by_mode["none"].total


def test_the_activation_peak_follows_the_schedule():
    gpipe = plan_for(parallel={"pp": 2, "microbatches": 4, "schedule": "gpipe"})
    one_f_one_b = plan_for(parallel={"pp": 2, "microbatches": 4, "schedule": "1f1b"})
    zero_bubble = [plan_for(parallel={"pp": 2, "microbatches": 4, "schedule": "zb-h1"}),
                   plan_for(parallel={"pp": 2, "vpp": 2, "microbatches": 4, "schedule": "zbv"})]
    for plan in (gpipe, one_f_one_b, *zero_bubble):  # with one byte per chunk the walk is the simulator's count
        peaks = describe(plan)["schedule"]["peak_activations"]
        assert [peak_activation_bytes(plan, p, [1] * plan.vpp) for p in range(plan.pp)] == peaks
    # GPipe holds all 4 micro-batches on the first stage, 1F1B two
    assert gpipe.memory()[0].activations == 2 * one_f_one_b.memory()[0].activations


def test_activations_scale_with_the_micro_batch_and_shrink_with_sequence_parallelism():
    small, large = plan_for(global_batch=4), plan_for(global_batch=8)
    assert 1.9 < large.memory()[0].activations / small.memory()[0].activations < 2.0  # positions are per sequence
    tp, sp = plan_for(parallel={"tp": 2}), plan_for(parallel={"tp": 2, "sp": True})
    assert sp.memory()[0].activations < tp.memory()[0].activations < plan_for().memory()[0].activations


def test_the_plan_describes_the_memory_of_every_rank_and_the_cli_shows_it():
    plan = plan_for(parallel={"pp": 2, "dp": 2, "microbatches": 2})
    memory = describe(plan)["memory"]
    assert [r["rank"] for r in memory["per_rank"]] == [0, 1, 2, 3]
    first = memory["per_rank"][0]
    assert first["total"] == sum(first[k] for k in ("params", "grads", "optimizer", "activations", "reduction")) + \
        max(first["recompute"], first["loss"])
    assert memory["largest"]["total"] == max(r["total"] for r in memory["per_rank"])
    text = format_plan(describe(plan))
    assert "ranks 0-1" in text and "ranks 2-3" in text and "activations" in text and "startup" in text


def test_the_start_up_peak_is_the_shards_and_the_largest_whole_parameter():
    """Construction on the meta device draws one whole parameter at a time: at zero=3 a rank holds its 1/dp shards
    and the largest parameter of its chunks whole (the embedding here, vocab x d_model, whatever tp or dp)."""
    zero3 = plan_for(parallel={"dp": 4, "tp": 2, "zero": 3})
    m = zero3.config.model
    first = estimate(zero3.layout, zero3.config)[0]
    assert first.construction == 4 * m.vocab_size * m.d_model
    assert first.startup == first.params - first.gathered + first.construction
    assert first.to_dict()["startup"] == first.startup
    whole = estimate(plan_for().layout, plan_for().config)[0]
    assert whole.params == 4 * real_numel(plan_for(), 0)
    assert whole.startup == whole.params + whole.construction  # zero=0: every parameter, and the one transient
    assert first.startup < whole.startup / 2


def huge_model(**overrides):
    return parse_spec(tiny_spec(model={"n_layer": 8, "d_model": 4096, "n_head": 32, "vocab_size": 65536,
                                       "seq_len": 256}, global_batch=8, **overrides))


def test_a_job_too_big_for_its_gpus_is_refused_naming_the_rank_and_the_numbers():
    gpus = ClusterResources(nodes=(NodeResources(cpus=64, gpus=8, memory=512 * GIB, gpu_memory=16 * GIB),))
    with pytest.raises(PlanError) as info:
        make_plan(huge_model(), gpus)
    message = info.value.message
    assert info.value.field == "model"
    assert message.startswith("rank 0 (pp0-tp0-dp0) needs ") and "but a GPU has 16 GiB" in message
    need = make_plan(huge_model()).memory()[0]
    assert f"params {need.params / GIB:,.1f}, grads {need.grads / GIB:,.1f}, optimizer {need.optimizer / GIB:,.1f}" \
        in message
    assert "raise pp or tp" in message
    # split over pp=2 x tp=4 it fits
    assert make_plan(huge_model(parallel={"pp": 2, "tp": 4}), gpus).world_size == 8


def test_a_gpu_job_whose_offloaded_state_exceeds_the_node_s_memory_is_refused_naming_the_host_bytes():
    offloaded = huge_model(optimizer={"offload": True})

    def node(memory: float) -> ClusterResources:
        return ClusterResources(nodes=(NodeResources(cpus=64, gpus=8, memory=memory, gpu_memory=80 * GIB),))

    need = make_plan(offloaded, node(1000 * GIB)).memory()[0]
    assert need.optimizer == 0 and need.host_resident == need.host > 4 * GIB  # pinned host copies and AdamW state
    assert make_plan(offloaded, node(need.host + GIB)).config.optimizer.offload  # the device fits: so does the host
    with pytest.raises(PlanError) as info:
        make_plan(offloaded, node(need.host - GIB))
    assert info.value.field == "optimizer.offload"
    assert info.value.message.startswith(f"rank 0 (pp0-tp0-dp0) needs {need.host / GIB:,.1f} GiB of host memory "
                                         f"(host_optimizer {need.host_optimizer / GIB:,.1f}")
    assert "of a node's memory" in info.value.message and "raise pp or tp" in info.value.message


def test_gpu_memory_unknown_skips_the_gpu_check():
    unknown = ClusterResources(nodes=(NodeResources(cpus=64, gpus=8, memory=1 * GIB),))
    assert make_plan(huge_model(), unknown).gpus_per_worker == 1


def test_cpu_ranks_share_their_nodes_memory():
    spec = parse_spec(tiny_spec(model={"n_layer": 4, "d_model": 512, "n_head": 8, "vocab_size": 4096},
                                parallel={"dp": 4}, global_batch=8))
    need = make_plan(spec).memory()[0].total
    # one node that fits one rank but not the four the job packs onto it
    node = ClusterResources(nodes=(NodeResources(cpus=8, gpus=0, memory=2 * need),))
    with pytest.raises(PlanError) as info:
        make_plan(spec, node)
    assert "on a node that would hold 4 of the job's ranks" in info.value.message
    assert "set parallel.zero: 1" in info.value.message
    assert make_plan(spec, ClusterResources(nodes=(NodeResources(cpus=8, gpus=0, memory=4 * need),))).dp == 4
    # two CPUs per node: a node holds two ranks, so each gets half of its memory
    two = ClusterResources(nodes=tuple(NodeResources(cpus=2, gpus=0, memory=2 * need) for _ in range(2)))
    assert make_plan(spec, two).dp == 4


def test_activations_too_large_name_the_global_batch():
    spec = parse_spec(tiny_spec(model={"seq_len": 4096, "d_model": 256, "n_head": 4}, global_batch=512))
    node = ClusterResources(nodes=(NodeResources(cpus=8, gpus=0, memory=16 * GIB),))
    with pytest.raises(PlanError) as info:
        make_plan(spec, node)
    assert info.value.field == "global_batch" and "activations" in info.value.message
    assert "set activation_checkpointing: full" in info.value.message


def test_gpu_memory_is_read_off_rays_accelerator_type():
    assert gpu_memory({"GPU": 8, "accelerator_type:H100": 1}) == 94 * GIB
    assert gpu_memory({"GPU": 4, "accelerator_type:A10G": 1}) == 24 * GIB
    assert gpu_memory({"GPU": 1, "accelerator_type:Unknown-9000": 1}) == 0
    assert gpu_memory({"CPU": 8}) == 0


def test_the_estimate_is_computed_once_per_stage_and_answers_a_large_layout_at_once():
    plan = plan_for(model={"moe": MOE}, parallel={"dp": 4, "ep": 2, "tp": 2, "pp": 2, "microbatches": 2})
    ranks = plan.memory()
    assert len(ranks) == 16 and len({id(r) for r in ranks}) == 2
    spec = parse_spec(tiny_spec(model={"n_layer": 4096, "moe": {"experts": 4096, "every": 1}},
                                parallel={"dp": 4096, "ep": 4096, "pp": 16}, global_batch=4096))
    large = make_plan(spec)
    # 65,536 ranks, 16 stages: one computation per stage, shared by the stage's ranks (not one per rank)
    assert len({id(r) for r in large.memory()}) == 16
    assert len(describe(large)["memory"]["per_rank"]) == 4096 * 16


def test_offloaded_host_copies_are_pinned_on_a_gpu_rank_each_rounded_up_to_a_power_of_two():
    """torch's pinned allocator rounds every block up to a power of two: a host copy and a host gradient of each
    matrix take that, the 1-D parameters their own size; a CPU rank's copies are not pinned."""
    model = {"family": "llama", "n_layer": 2, "d_model": 96, "n_head": 4, "ffn_hidden": 200, "vocab_size": 300}
    offload = {"model": model, "optimizer": {"offload": True}}
    plan = plan_for(**offload)
    cpu, gpu = plan.memory()[0], plan_for(**offload, resources={"gpus_per_worker": 1}).memory()[0]
    m = plan.config.model
    shapes = family_of(m).matrices(m, range(2), first=True, last=True, tp=1, ep=1)
    rounding = sum(2 * ((1 << (4 * r * c - 1).bit_length()) - 4 * r * c) for r, c, _ in shapes)
    assert rounding > 0 and gpu.host_optimizer - cpu.host_optimizer == rounding
