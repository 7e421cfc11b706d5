"""The optimizer registry's kinds in-process: the state each really keeps against the bytes the registry
claims, the checkpoint form's round trip (8-bit against torchao's own quantization, factored against the
factors), the pieces a factored kind cuts a ZeRO-1 slice into, offload's host step against the plain one,
and the memory plan's device/host split."""

from __future__ import annotations

import pytest
import torch
from trainyard.parallel.config import OptimizerConfig
from trainyard.parallel.optim.adafactor import Adafactor
from trainyard.parallel.optim.kinds import ADAFACTOR, ADAMW, ADAMW4BIT, ADAMW8BIT, OPTIMIZERS, SGD
from trainyard.parallel.optim.states import export, load, tensor_bytes
from trainyard.parallel.runtime.train_optimizer import TrainOptimizer


def _param(shape: tuple[int, ...], seed: int = 0) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))
    return p


def _stepped(kind: str, p: torch.nn.Parameter, steps: int = 2, **cfg) -> TrainOptimizer:
    opt = TrainOptimizer([(p, p)], OptimizerConfig(kind=kind, **cfg))
    for _ in range(steps):
        opt.step()
    return opt


def test_each_kind_keeps_the_state_bytes_the_registry_claims():
    assert set(OPTIMIZERS) == {"adamw", "adamw8bit", "adamw4bit", "adafactor", "sgd"}
    shape = (64, 256)
    n = shape[0] * shape[1]
    measured = {kind: _stepped(kind, _param(shape)).state_bytes()[0] for kind in OPTIMIZERS}
    assert measured["adamw"] == ADAMW.state_bytes(n) == 8 * n
    # 8-bit codes and a scale per 256-element block for both moments, plus torchao's two 256-entry maps
    assert measured["adamw8bit"] == ADAMW8BIT.state_bytes(n) + 2 * 256 * 4
    assert measured["adamw8bit"] <= 0.27 * measured["adamw"]
    # 4-bit: two codes a byte and a scale per 128-element block for both moments, plus torchao's two 16-entry maps
    assert measured["adamw4bit"] == ADAMW4BIT.state_bytes(n) + 2 * 16 * 4
    assert ADAMW4BIT.state_bytes(n) == 2 * (n // 2 + 4 * n // 128)  # about 0.53 B per element per moment
    assert measured["adamw4bit"] <= 0.14 * measured["adamw"]
    # factored: one fp32 per row and per column
    assert measured["adafactor"] == 4 * (shape[0] + shape[1])
    assert ADAFACTOR.state_bytes(n, d_model=shape[0]) >= measured["adafactor"]
    assert measured["sgd"] == SGD.state_bytes(n) == 4 * n  # one momentum buffer


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_sgd_steps_as_torchs_sgd_and_its_momentum_round_trips(momentum):
    """The outside reference: torch's SGD with the same momentum and (coupled) weight decay on a matrix, the
    vector beside it without decay; then the momentum buffer through the checkpoint form and back."""
    ours, theirs = [_param((8, 16)), _param((16,), seed=2)], [_param((8, 16)), _param((16,), seed=2)]
    opt = TrainOptimizer([(p, p) for p in ours], OptimizerConfig(kind="sgd", lr=0.1, beta1=momentum))
    ref = torch.optim.SGD([{"params": theirs[:1], "weight_decay": 0.1}, {"params": theirs[1:], "weight_decay": 0.0}],
                          lr=0.1, momentum=momentum)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = b.grad = torch.randn(a.shape, generator=gen)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    inner, p = opt.optimizers[0], ours[0]
    assert opt.state_bytes()[0] == SGD.state_bytes(sum(t.numel() for t in ours))  # at momentum 0 too (zeros)
    saved = {k: v.clone() for k, v in export(SGD, inner, p).items()}
    expected = ref.state[theirs[0]]["momentum_buffer"] if momentum else torch.zeros_like(p)  # kept, unused at 0
    torch.testing.assert_close(saved["momentum_buffer"], expected)
    inner.state[p]["momentum_buffer"].zero_()
    load(SGD, inner, p, saved)
    torch.testing.assert_close(inner.state[p]["momentum_buffer"], expected)


def test_8bit_state_round_trips_through_the_checkpoint_form_as_torchao_quantizes_it():
    from torchao.optim.subclass_8bit import OptimState8bit

    p = _param((32, 256))
    opt = _stepped("adamw8bit", p)
    inner = opt.optimizers[0]
    state = inner.state[p]
    assert isinstance(state["exp_avg"], OptimState8bit)
    saved = export(ADAMW8BIT, inner, p)
    # the checkpoint form is torchao's own dequantization, fp32 in the parameter's shape
    assert saved["exp_avg"].dtype == torch.float32 and saved["exp_avg"].shape == p.shape
    torch.testing.assert_close(saved["exp_avg_sq"], state["exp_avg_sq"].dequantize())
    codes = state["exp_avg"].codes.clone()
    state["exp_avg"].copy_(torch.zeros_like(saved["exp_avg"]))
    load(ADAMW8BIT, inner, p, saved)
    assert torch.equal(state["exp_avg"].codes, codes)  # re-quantizing a dequantized state gives its codes back
    # and against fp32 AdamW after the same steps: within the 8-bit quantization error
    ref = _param((32, 256))
    reference = _stepped("adamw", ref)
    assert (saved["exp_avg"] - reference.optimizers[0].state[ref]["exp_avg"]).abs().max() < 0.02


def test_4bit_state_round_trips_through_the_checkpoint_form_within_its_quantization_step():
    """adamw4bit's moments (torchao's OptimState4bit) saved as AdamW's fp32 tensors and quantized again on load:
    the dequantized state after the round trip is the saved one within a block's 4-bit step. The second moment's
    map (linear, 1/16 to 1) reaches 1, so its codes come back as they were; the first moment's signed map reaches
    1 but only -0.8875, so a block that holds no code of 1 (its largest moment was negative) comes back up to 11%
    smaller (torchao's own step re-quantizes the same way), and the other blocks come back as they were. Both
    moments follow fp32 AdamW's within the 4-bit error."""
    from torchao.optim.subclass_4bit import OptimState4bit

    p = _param((32, 256))
    opt = _stepped("adamw4bit", p)
    inner = opt.optimizers[0]
    state = inner.state[p]
    assert isinstance(state["exp_avg"], OptimState4bit) and isinstance(state["exp_avg_sq"], OptimState4bit)
    saved = {k: v.clone() for k, v in export(ADAMW4BIT, inner, p).items()}
    assert saved["exp_avg"].dtype == torch.float32 and saved["exp_avg"].shape == p.shape
    torch.testing.assert_close(saved["exp_avg_sq"], state["exp_avg_sq"].dequantize())
    reaches_one = saved["exp_avg"].view(-1, 128).amax(dim=1) == state["exp_avg"].scale  # a code of 1.0 in it
    assert 0 < int(reaches_one.sum()) < reaches_one.numel()  # both kinds of block are here
    for key in ADAMW4BIT.state:
        quantized = state[key]
        step = (quantized.qmap.sort().values.diff().max() * quantized.scale).repeat_interleave(128).view(p.shape)
        quantized.copy_(torch.zeros_like(saved[key]))
        assert quantized.dequantize().abs().max() < 1e-12  # cleared (the unsigned map has no 0): load refills it
        load(ADAMW4BIT, inner, p, saved)
        back = quantized.dequantize()
        assert ((back - saved[key]).abs() <= step).all()
        as_they_were = (back == saved[key]).view(-1, 128).all(dim=1)
        assert as_they_were.all() if key == "exp_avg_sq" else as_they_were.equal(reaches_one)
    ref = _param((32, 256))
    reference = _stepped("adamw", ref).optimizers[0].state[ref]
    for key in ADAMW4BIT.state:  # within a step of the map (its widest gap: 0.225 of a block's largest moment)
        error = (saved[key] - reference[key]).view(-1, 128).abs().amax(dim=1)
        assert (error <= 0.225 * reference[key].view(-1, 128).abs().amax(dim=1)).all()
    opt.step()  # and it steps on from the loaded state
    assert int(inner.state[p]["step"]) == 3


@pytest.mark.parametrize("scale_parameter", [True, False])
def test_adafactor_steps_as_transformers_adafactor_does(scale_parameter):
    """The outside reference: HF's Adafactor without its relative step and first moment (with the step
    relative to the parameter's RMS, as the registry builds it, and without), on the same matrix, vector and
    gradients, under a changing lr (the job's schedule) and weight decay."""
    from transformers.optimization import Adafactor as HFAdafactor

    ours, theirs = [_param((16, 24)), _param((24,), seed=2)], [_param((16, 24)), _param((24,), seed=2)]
    groups = [{"params": ours, "weight_decay": 0.1}]
    opt = (OPTIMIZERS["adafactor"].build(groups, OptimizerConfig(kind="adafactor")) if scale_parameter
           else Adafactor(groups, scale_parameter=False))
    ref = HFAdafactor(theirs, lr=1e-3, scale_parameter=scale_parameter, relative_step=False, warmup_init=False,
                      beta1=None, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    for step, lr in enumerate([1e-3, 3e-2, 1e-2, 5e-3, 2e-3] if not scale_parameter else [0.1, 0.5, 0.3, 0.2, 0.1]):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = b.grad = torch.randn(a.shape, generator=gen) * 10.0 ** -step  # the clipping bites early
        for g in (*opt.param_groups, *ref.param_groups):
            g["lr"] = lr
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert any((a - _param(a.shape, s)).abs().max() > 1e-2 for a, s in zip(ours, (0, 2), strict=True))
    torch.testing.assert_close(opt.state[ours[0]]["row_var"].view(-1), ref.state[theirs[0]]["exp_avg_sq_row"])
    torch.testing.assert_close(opt.state[ours[0]]["col_var"].view(-1), ref.state[theirs[0]]["exp_avg_sq_col"])


def test_adafactor_keeps_rows_of_zero_gradients_beside_large_ones_finite():
    """An embedding's rows of absent tokens have zero gradients. Beside a row of large ones (grad_clip 0 and a loss
    spike: a norm of ~1e10 here, finite, so no DivergedError) their ratio to the mean row underflowed to 0 in fp32,
    and its rsqrt, inf, times their zero gradient made the whole matrix NaN at once. The steps now equal HF's
    Adafactor run in float64, where nothing underflows."""
    from transformers.optimization import Adafactor as HFAdafactor

    ours = _param((16, 64))
    theirs = torch.nn.Parameter(ours.detach().double().clone())
    opt = OPTIMIZERS["adafactor"].build([{"params": [ours], "weight_decay": 0.1}], OptimizerConfig(kind="adafactor"))
    ref = HFAdafactor([theirs], lr=0.1, scale_parameter=True, relative_step=False, warmup_init=False, beta1=None,
                      weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    for token in (3, 3, 9):
        grad = torch.zeros(16, 64)
        grad[token] = 1e9 * torch.randn(64, generator=gen)
        ours.grad, theirs.grad = grad, grad.double()
        opt.param_groups[0]["lr"] = 0.1
        opt.step()
        ref.step()
        assert torch.isfinite(ours).all() and all(torch.isfinite(t).all() for t in opt.state[ours].values())
        torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-6)


def test_factored_state_round_trips_and_refactors_exactly():
    p = _param((16, 24))
    opt = _stepped("adafactor", p)
    inner, (leaf,) = opt.optimizers[0], opt.leaves[p]  # a whole matrix: one leaf, a 2-D view of p
    state = inner.state[leaf.held]
    rows, cols = state["row_var"].clone(), state["col_var"].clone()
    assert rows.shape == (16, 1) and cols.shape == (1, 24)
    v = export(ADAFACTOR, inner, leaf.held)["exp_avg_sq"]
    assert v.shape == p.shape
    state["row_var"].zero_()
    state["col_var"].zero_()
    load(ADAFACTOR, inner, leaf.held, {"exp_avg_sq": v})
    torch.testing.assert_close(state["row_var"], rows)
    torch.testing.assert_close(state["col_var"], cols)


def test_a_factored_kind_cuts_a_zero1_slice_into_whole_rows_and_partial_ones():
    p = _param((6, 10))
    piece = p.detach().view(-1)[7:53]  # starts in row 0 and ends in row 5, as a ZeRO-1 slice may
    piece.grad = p.grad.view(-1)[7:53]
    opt = TrainOptimizer([(piece, p)], OptimizerConfig(kind="adafactor"))
    leaves = opt.leaves[piece]
    assert [(leaf.start, tuple(leaf.tensor.shape)) for leaf in leaves] == [(0, (3,)), (3, (4, 10)), (43, (3,))]
    before = p.detach().clone()
    opt.step()
    changed = (p.detach() != before).view(-1)
    assert changed[7:53].all() and not changed[:7].any() and not changed[53:].any()  # the update lands in p
    assert set(opt.export().state[piece]) == {"exp_avg_sq"} and opt.export().state[piece]["exp_avg_sq"].shape == (46,)


def test_offloaded_step_equals_the_plain_one_and_moves_the_state_to_the_host():
    plain, offloaded = _param((8, 16)), _param((8, 16))
    a = _stepped("adamw", plain, steps=3)
    b = TrainOptimizer([(offloaded, offloaded)], OptimizerConfig(), offload=True)
    for _ in range(3):
        b.step()
    assert torch.equal(plain, offloaded)
    assert b.state_bytes() == (0, a.state_bytes()[0] + 2 * 4 * plain.numel())
    assert all(t is not offloaded for o in b.optimizers for g in o.param_groups for t in g["params"])


def test_tensor_bytes_counts_what_a_tensor_subclass_holds():
    from torchao.optim.subclass_8bit import OptimState8bit

    state = OptimState8bit.zeros((4, 512), signed=True, block_size=256)
    assert tensor_bytes(state) == 4 * 512 + 4 * 8 + 4 * 256
    assert tensor_bytes(torch.tensor(1.0)) == 0


def test_the_memory_plan_splits_device_and_host_bytes():
    from helpers import tiny_spec
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.plan.memory.estimate import estimate
    from trainyard.parallel.spec import parse_spec

    def memory(**kw):
        config = parse_spec(tiny_spec(**kw))
        return estimate(make_plan(config).layout, config)[0]

    base, offload = memory(), memory(optimizer={"offload": True}, activation_offload=True)
    assert offload.optimizer == 0 and offload.host_optimizer == base.optimizer + 2 * base.params
    assert offload.activations + offload.host_activations == base.activations
    assert 0 < offload.activations < base.activations and offload.total < base.total
    assert base.host == 0 and offload.to_dict()["host_total"] == offload.host
    assert memory(optimizer={"kind": "adamw8bit"}).optimizer < 0.27 * base.optimizer
    four = memory(optimizer={"kind": "adamw4bit"}).optimizer  # about 0.53 B per parameter and moment, of AdamW's 4
    assert 0.13 * base.optimizer < four < 0.14 * base.optimizer
    assert memory(optimizer={"kind": "adafactor"}).optimizer < 0.1 * base.optimizer


def test_adamw_steps_in_chunks_of_step_chunk_elements_with_the_bits_of_one_step_over_all(monkeypatch):
    """Each torch optimizer steps at most STEP_CHUNK elements (a foreach step's temporaries are as large as what it
    steps): chunked, the update is elementwise the same, so the same bits as one optimizer over every tensor."""
    from trainyard.parallel.runtime import train_optimizer

    shapes = [(16, 32), (32, 16), (64,), (8, 64)]
    whole, chunked = ([_param(s, seed=i) for i, s in enumerate(shapes)] for _ in range(2))
    one = TrainOptimizer([(p, p) for p in whole], OptimizerConfig(kind="adamw", weight_decay=0.1))
    monkeypatch.setattr(train_optimizer, "STEP_CHUNK", 600)
    many = TrainOptimizer([(p, p) for p in chunked], OptimizerConfig(kind="adamw", weight_decay=0.1))
    assert len(one.optimizers) == 2 and len(many.optimizers) == 4  # by decay; then each 512-element matrix alone
    assert max(sum(p.numel() for g in o.param_groups for p in g["params"]) for o in many.optimizers) <= 600
    for _ in range(2):
        one.step()
        many.step()
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))
