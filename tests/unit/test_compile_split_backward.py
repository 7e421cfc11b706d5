"""`compile: true` under a split backward (zb-h1, zbv): compiled blocks keep their linears eager, so the input half
runs each linear's input-gradient matmul and the weight half its weight-gradient matmul, once each, as eager does,
with eager's gradients; a block compiled whole runs every matmul in both halves. Counted with a TorchDispatchMode,
which sees the compiled regions' operations too (aot_eager runs AOTAutograd's graphs op by op: the whole-block
count is how the test knows)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import trainyard.parallel.runtime.compile as compile_
from helpers import slow
from torch.utils._python_dispatch import TorchDispatchMode
from trainyard.parallel.config.model import ModelConfig, MoEConfig
from trainyard.parallel.models import family_of
from trainyard.parallel.models.components.moe import MoELayer
from trainyard.parallel.runtime.pipeline.split_backward import backward_input, backward_weight

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten._grouped_mm.default}


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setattr(compile_, "BACKEND", "aot_eager")  # no code generation: the graphs run op by op
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def split_backward(stage, one_call: bool = False) -> tuple[list[int], torch.Tensor, dict[str, torch.Tensor]]:
    """Matmuls run by (input half, weight half) of one micro-batch's backward through `stage`, the input's gradient
    and the parameters' gradients. (The forward runs outside the counting mode: under a dispatch mode dynamo would
    not compile it, and the block would run eager.)"""
    x = torch.randn(2, 16, stage.cfg.d_model, generator=torch.Generator().manual_seed(3), requires_grad=True)
    params, counts = list(stage.parameters()), []
    out = stage(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    with CountMatmuls() as input_half:
        dx, groups = backward_input(out, grad, x, params)
    counts.append(input_half.count)
    with CountMatmuls() as weight_half:
        backward_weight(groups, params, one_call=one_call)
    counts.append(weight_half.count)
    return counts, dx, {name: p.grad for name, p in stage.named_parameters()}


CFG = ModelConfig(n_layer=2, n_head=2, d_model=32, vocab_size=256, seq_len=16, moe=MoEConfig(experts=2, every=2))
"""gpt2 (LayerNorm, biases) with a dense block and an MoE block (router, experts): every kind of parameter a block
holds. (llama's differ in no way that matters here: RMSNorm's weight, linears without biases.)"""


def stage(grouped: bool = True):
    """Both blocks, not first or last: hidden states in and out, as a middle pipeline stage; the experts as one
    grouped matmul per weight (torch runs them on CPU too), or one expert after another."""
    built = family_of(CFG).build_stage(CFG, [0, 1], first=False, last=False, seed=1)
    for layer in built.modules():
        if isinstance(layer, MoELayer):
            layer.grouped_mm = grouped
    return built


def test_each_half_runs_eagers_matmuls_once_with_eagers_gradients():
    eager_counts, eager_dx, eager_grads = split_backward(stage())
    # dense block: q, k, v, proj, fc, proj; MoE block: q, k, v, proj, router and the experts' two grouped matmuls
    assert eager_counts == [13, 13]
    counts, dx, grads = split_backward(compile_.compile_blocks(stage(), separable_weights=True))
    assert counts == eager_counts
    torch.testing.assert_close(dx, eager_dx, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name, g in eager_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


@slow
def test_a_block_compiled_whole_runs_every_matmul_in_both_halves():
    """Why the linears stay eager, and how the count above knows it sees into compiled regions. (The loop over the
    experts: dynamo does not trace the grouped matmul on CPU.)"""
    eager_counts, _, _ = split_backward(stage(grouped=False))
    whole_counts, _, _ = split_backward(compile_.compile_blocks(stage(grouped=False)))
    assert whole_counts == [sum(eager_counts)] * 2


def test_a_matrix_outside_a_linear_is_refused():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = torch.nn.Parameter(torch.ones(4, 4))

        def forward(self, x):
            return x @ self.mix

    with pytest.raises(ValueError, match=r"\['mix'\] would be multiplied inside a compiled region"):
        compile_.keep_matmuls_eager(Scaled())


def test_a_recomputed_block_is_recomputed_once_in_the_weight_half_not_once_per_parameter_group():
    """Full activation checkpointing: each backward call recomputes the checkpointed forward, so the weight half
    runs one backward over every group (`backward_weight(one_call=True)`, what the executor asks for a recomputing
    chunk), with the same gradients as torch's call per group."""
    def recomputing():
        built = stage()
        built.set_activation_checkpointing("full")
        return built
    (per_group_in, per_group_w), _, per_group = split_backward(recomputing())
    (one_in, one_w), _, one = split_backward(recomputing(), one_call=True)
    assert per_group_in == one_in and one_w < per_group_w / 2, (per_group_w, one_w)
    for name, g in per_group.items():
        torch.testing.assert_close(one[name], g, rtol=1e-6, atol=1e-6)
