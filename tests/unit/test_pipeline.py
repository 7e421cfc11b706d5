"""The pipeline executor dispatches each action by its kind, and refuses a kind it has no handler for."""

import enum

import pytest
import torch
from helpers import tiny_spec
from trainyard.parallel.models.whole import GPTStage, full_model
from trainyard.parallel.plan.schedule.actions import Action, ActionKind
from trainyard.parallel.plan.schedule.schedules import build_schedule
from trainyard.parallel.runtime.pipeline.pipeline import (
    HANDLERS,
    PipelineExecutor,
    UnsupportedAction,
    _SavedTensorMeter,
)
from trainyard.parallel.runtime.pipeline.split_backward import backward_input, backward_weight
from trainyard.parallel.spec import parse_spec

CFG = parse_spec(tiny_spec(model={"n_layer": 4})).model


class FutureKind(enum.Enum):
    """Kinds a later schedule may emit (DualPipeV's overlapped forward-backward) that this executor does not run."""

    OVERLAP_F_B = "OVERLAP_F_B"


def executor(chunks: list[GPTStage]) -> PipelineExecutor:
    return PipelineExecutor(chunks, pp_rank=0, pp=1, pp_ranks=[0], activation_shape=(1,),
                            device=torch.device("cpu"), loss_scale=1.0)


def test_every_kind_a_schedule_emits_has_a_handler():
    assert set(HANDLERS) == set(ActionKind)


@pytest.mark.parametrize("kind", list(FutureKind))
def test_an_action_kind_without_a_handler_is_refused_before_anything_runs(kind):
    stage = GPTStage(CFG, [0, 1, 2, 3], first=True, last=True, seed=3)
    actions = [Action(ActionKind.FORWARD, 0, 0), Action(kind, 0, 0)]
    batch_calls = []
    with pytest.raises(UnsupportedAction, match=kind.name):
        executor([stage]).run(actions, lambda mb: batch_calls.append(mb))
    assert batch_calls == []  # not even the forward ran
    assert all(p.grad is None for p in stage.parameters())


def test_a_two_chunk_single_rank_schedule_gives_the_full_models_loss_and_gradients():
    tokens = torch.randint(256, (2, 17), generator=torch.Generator().manual_seed(0))
    full = full_model(CFG, seed=5)
    expected = full.loss_sum(full(tokens[:, :-1]), tokens[:, 1:])
    expected.backward()
    chunks = [GPTStage(CFG, [0, 1], first=True, last=False, seed=5), GPTStage(CFG, [2, 3], first=False, last=True,
                                                                             seed=5)]
    actions = build_schedule("gpipe", pp=1, microbatches=1, vpp=2)[0]
    ex = executor(chunks)
    loss, timings = ex.run(actions, lambda mb: (tokens[:, :-1], tokens[:, 1:]))
    torch.testing.assert_close(loss, expected.detach())
    assert timings.peak_activations == 2
    # On CPU the actions are timed on the host as they run (stage_clock): nothing is left for `settle`.
    assert not ex.clock.on_device and ex.clock._pending == []
    assert 0 < timings.forward_s and 0 < timings.backward_s
    assert timings.forward_s + timings.backward_s <= timings.schedule_s
    grads = {n: p.grad for chunk in chunks for n, p in chunk.named_parameters()}
    for name, p in full.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_a_split_backward_gives_the_full_models_gradients_each_accumulated_once_per_micro_batch(recompute):
    # zbv on one rank: chunk 1 (virtual stage 1) runs every backward split in two, its input half handing the
    # gradient to chunk 0 locally, chunk 0 (stage 0, token ids in) runs its whole backward as its weight half.
    tokens = torch.randint(256, (4, 17), generator=torch.Generator().manual_seed(1))
    full = full_model(CFG, seed=5)
    full.loss_sum(full(tokens[:, :-1]), tokens[:, 1:]).backward()
    chunks = [GPTStage(CFG, [0, 1], first=True, last=False, seed=5), GPTStage(CFG, [2, 3], first=False, last=True,
                                                                             seed=5)]
    accumulated = []
    for chunk in chunks:
        chunk.set_activation_checkpointing(recompute)
        for name, p in chunk.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated.append(name))
    actions = build_schedule("zbv", pp=1, microbatches=2, vpp=2)[0]
    assert {a.kind for a in actions} >= {ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
    loss, timings = executor(chunks).run(actions, lambda mb: (tokens[2 * mb:2 * mb + 2, :-1],
                                                               tokens[2 * mb:2 * mb + 2, 1:]))
    grads = {n: p.grad for chunk in chunks for n, p in chunk.named_parameters()}
    for name, p in full.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    assert sorted(accumulated) == sorted(2 * list(grads))  # the reducer's hooks fire as in a whole backward
    assert timings.peak_activations == 2  # as the simulator counts: zbv on one rank is F F I W per micro-batch


def test_a_split_backward_leaves_nothing_saved_once_both_halves_ran():
    # scaled_dot_product_attention saves its own output: metered with its history, that node would keep itself
    # alive after the weight half (which never runs the input path's nodes), one leak per micro-batch.
    stage = GPTStage(CFG, [2, 3], first=False, last=True, seed=5)
    params = list(stage.parameters())
    meter = _SavedTensorMeter(params)
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        for _ in range(2):
            x = torch.randn(2, 16, CFG.d_model, requires_grad=True)
            loss = stage.loss_sum(stage(x), tokens)
            held = meter.live
            dx, groups = backward_input(loss, None, x, params)
            # Nothing is let go yet: the loss, fused with the head, is where the head's weight meets the input's
            # path, so the weight half runs it again (it holds the gradients it computed in forward, no logits).
            assert meter.live == held > 0
            del loss
            backward_weight(groups, params)
            del groups
            assert meter.live == 0
