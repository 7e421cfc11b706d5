"""What a tensor-parallel rank sends between pipeline stages, and where the loss runs (pure: no process group)."""

import contextlib

from helpers import tiny_spec
from torch.distributed.tensor.parallel import loss_parallel
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.tp.tensor_parallel import activation_shape, loss_context
from trainyard.parallel.spec import parse_spec


def plan_for(**parallel):
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 2, "seq_len": 16, "d_model": 32}, global_batch=8,
                                          parallel={"pp": 2, "microbatches": 2, **parallel})))


def test_stages_exchange_whole_activations_without_sp():
    assert activation_shape(plan_for(tp=2)) == (4, 16, 32)


def test_stages_exchange_sequence_slices_with_sp():
    assert activation_shape(plan_for(tp=2, sp=True)) == (4, 8, 32)


def test_loss_runs_under_loss_parallel_only_when_the_head_is_sharded():
    assert loss_context(plan_for(tp=2)) is loss_parallel
    assert loss_context(plan_for()) is contextlib.nullcontext
