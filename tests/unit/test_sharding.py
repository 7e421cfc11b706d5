"""Data-parallel sharding strategies: one per `parallel.zero` value, and the bytes they keep per rank."""

import typing

import pytest
from helpers import tiny_spec
from trainyard.parallel.config import ParallelConfig
from trainyard.parallel.plan import can_move_in_memory, make_plan, resized
from trainyard.parallel.plan.sharding import SHARDINGS, sharding_for
from trainyard.parallel.spec import parse_spec


def test_every_zero_value_the_spec_accepts_has_a_strategy():
    allowed = typing.get_args(typing.get_type_hints(ParallelConfig)["zero"])
    assert set(allowed) == set(SHARDINGS)
    assert all(SHARDINGS[z].zero == z for z in allowed)


def test_zero_0_keeps_everything_and_zero_1_keeps_a_slice_of_the_optimizer_state():
    plain, zero1 = sharding_for(0), sharding_for(1)
    assert (plain.gradient_elements(10, 4), plain.optimizer_elements(10, 4)) == (10, 10)
    assert (zero1.gradient_elements(10, 4), zero1.optimizer_elements(10, 4)) == (13, 3)  # whole buckets + slice
    assert zero1.gradient_elements(10, 1) == 10  # a group of one has nothing to split
    assert plain.replicas_identical and not zero1.replicas_identical


def test_zero_2_and_3_keep_a_shard_of_everything_and_gather_every_chunk_or_two_units():
    zero2, zero3 = sharding_for(2), sharding_for(3)
    for z in (zero2, zero3):
        assert (z.param_elements(10, 4), z.gradient_elements(10, 4), z.optimizer_elements(10, 4)) == (3, 3, 3)
        assert (z.param_elements(10, 1), z.gradient_elements(10, 1)) == (10, 10)  # a group of one: all of it
        assert z.shards_parameters and not z.replicas_identical
    # ZeRO-2 holds every unit whole during the step; ZeRO-3 the unit computing and the next one's gather
    forward = [("embedding", 5), ("block 0", 7), ("block 1", 6)]
    passes = [forward, forward[::-1]]
    assert (zero2.gathered_elements(passes), zero3.gathered_elements(passes)) == (18, 13)
    assert zero3.gathered_elements([[("block 0", 5)], [("block 0", 5)]]) == 5  # the next compute's is itself
    # the next compute's first unit is gathered while this one's last computes
    assert zero3.gathered_elements([[("a", 5), ("b", 7)], [("c", 9)]]) == 7 + 9
    # tied embeddings: the unit a forward runs first and last is held in between
    tied = [("tied", 4), ("block 0", 7), ("block 1", 6), ("tied", 4)]
    assert zero3.gathered_elements([tied, tied[::-1]]) == 4 + 7 + 6
    assert sharding_for(1).gathered_elements(passes) == 0 and not sharding_for(1).shards_parameters


def test_an_unknown_zero_value_names_the_field():
    with pytest.raises(ValueError, match="parallel.zero=4"):
        sharding_for(4)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_resize_keeps_the_state_in_memory_only_where_replicas_are_identical(zero):
    elastic = {"dp": {"min": 1, "max": 4}, "microbatches": 4, "zero": zero}
    config = parse_spec(tiny_spec(parallel=elastic, global_batch=8))
    old, new = make_plan(resized(config, 2)), make_plan(resized(config, 4))
    assert can_move_in_memory(old, new) == (zero == 0)  # ZeRO-1/2/3 shards move through a checkpoint
