"""Context parallelism's pure parts: the head-tail chunks, their balance, the log-sum-exp merge against one softmax,
the positions and masks by global index, the layout's groups and the rules' 422s."""

import pytest
import torch
from helpers import tiny_spec
from trainyard.cli.offline import format_plan
from trainyard.parallel.models.components.documents import document_mask
from trainyard.parallel.plan import Layout, PlanError, make_plan
from trainyard.parallel.plan.memory.estimate import estimate
from trainyard.parallel.plan.present import describe
from trainyard.parallel.runtime.cp.chunks import attention_work, local_indices, rank_chunks, take
from trainyard.parallel.runtime.cp.ring import Mask, block_attention, merge
from trainyard.parallel.spec import parse_spec

LLAMA = {"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 64}


def test_rank_i_holds_chunks_i_and_its_mirror_and_the_group_covers_the_sequence_once():
    assert [rank_chunks(i, 4) for i in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    held = torch.cat([local_indices(32, i, 4) for i in range(4)])
    assert sorted(held.tolist()) == list(range(32))
    assert local_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not divisible"):
        local_indices(10, 0, 2)


def test_head_tail_chunks_give_every_rank_the_same_causal_attention_work():
    for cp in (2, 4, 8):
        work = {attention_work(64, i, cp) for i in range(cp)}
        assert len(work) == 1, (cp, work)
    # a plain split (rank i holds chunk i) is unbalanced: the last rank's queries see every key
    plain = [int(torch.arange(i * 16, (i + 1) * 16).add(1).sum()) for i in range(4)]
    assert max(plain) > 3 * min(plain)


def test_positions_are_global_indices_so_a_rank_rotates_as_the_whole_sequence_does():
    x = torch.arange(2 * 16).view(2, 16)
    mine = take(x, local_indices(16, 1, 2))
    assert mine.tolist()[0] == [4, 5, 6, 7, 8, 9, 10, 11]


def test_partials_merged_by_log_sum_exp_equal_one_softmax_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    everything = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    expected, expected_lse = block_attention(q, k, v, everything)
    halves = [block_attention(q, k[:, :, s], v[:, :, s], everything[..., s]) for s in (slice(0, 2), slice(2, 5))]
    out, lse = merge(*halves[0], *halves[1])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)
    reference = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
    torch.testing.assert_close(out, reference)


def test_a_wholly_masked_block_merges_as_nothing():
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    causal = torch.ones(4, 4).tril().bool().view(1, 1, 4, 4)
    out, lse = block_attention(q, k, v, causal)
    nothing = block_attention(q, k, v, torch.zeros(1, 1, 4, 4, dtype=torch.bool))
    assert torch.isinf(nothing[1]).all() and not nothing[0].isnan().any()
    merged = merge(out, lse, *nothing)
    torch.testing.assert_close(merged[0], out)


def test_the_ring_masks_by_global_index_as_the_whole_sequence_mask_does():
    segments = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6])  # boundaries inside chunks of 4
    indices = [local_indices(16, r, 2) for r in range(2)]
    for window in (None, 3):
        whole = document_mask(segments, window)[0, 0]
        mask = Mask(indices, segments, window)
        for qr in range(2):
            for kr in range(2):
                block = mask.block(qr, kr)
                expected = whole[indices[qr]][:, indices[kr]]
                assert (block is None and not expected.any()) or torch.equal(block[0, 0], expected)


def test_the_cp_group_sits_inside_a_replica_and_the_gradients_sum_over_dp_x_cp():
    layout = Layout.build(dp=2, pp=1, tp=2, cp=2, layer_counts=[2])
    assert layout.world_size == 8
    assert layout.cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.worker_name(3) == "pp0-tp1-dp0-cp1"
    assert layout.gang.count == 4


@pytest.mark.parametrize("parallel,model,field,rule", [
    ({"cp": 3}, {}, "parallel.cp", "must divide model.seq_len"),
    ({"cp": 2}, {"moe": {"experts": 2, "top_k": 1}}, "parallel.cp", "model.moe"),
    ({"cp": 2, "sync": {"kind": "diloco"}, "dp": 2}, {}, "parallel.cp", "parallel.sync.kind"),
    ({"cp": 4, "tp": 4, "sp": True}, {"n_kv_head": 4, "seq_len": 24}, "parallel.sp", "seq_len / cp"),
    ({"cp": 2}, {"family": "gpt2"}, "parallel.cp", "model.family=gpt2"),
])
def test_plan_rejects_what_cp_does_not_compose_with_naming_both_fields(parallel, model, field, rule):
    spec = tiny_spec(model={**LLAMA, **model}, global_batch=4, parallel=parallel)
    if model.get("family") == "gpt2":
        spec["model"] = {k: v for k, v in spec["model"].items() if k not in ("n_kv_head", "ffn_hidden")}
    with pytest.raises(PlanError, match=rule) as err:
        make_plan(parse_spec(spec))
    assert err.value.field == field


def test_a_cp_plan_lays_out_its_ranks():
    plan = make_plan(parse_spec(tiny_spec(model=LLAMA, global_batch=4, parallel={"dp": 2, "cp": 2, "zero": 3})))
    assert (plan.world_size, plan.cp) == (4, 2)
    assert [(c.dp, c.cp) for c in plan.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_memory_plan_counts_a_rank_activations_at_one_cp_th_of_the_sequence():
    def activations(cp: int, seq_len: int) -> int:
        spec = tiny_spec(model={**LLAMA, "seq_len": seq_len}, global_batch=4, parallel={"cp": cp})
        return estimate(make_plan(parse_spec(spec)).layout, parse_spec(spec))[0].activations

    assert activations(2, 64) == activations(1, 32)
    assert activations(4, 128) == activations(1, 32)
    assert activations(4, 64) < activations(1, 64) / 3


def test_the_plan_preview_shows_the_cp_group():
    plan = make_plan(parse_spec(tiny_spec(model=LLAMA, global_batch=4, parallel={"cp": 2})))
    described = describe(plan)
    assert described["degrees"]["cp"] == 2 and described["groups"]["cp"] == [[0, 1]]
    assert "context-parallel groups" in format_plan(described) and "cp=2" in format_plan(described)
