"""Gradients in place (`parallel.runtime.dp.data_parallel`): backward's gradients land in the reduction buckets, and
a step neither zeroes the buckets nor adds a first gradient into them. And the overlap: a model smaller than one
whole bucket still gets a small first bucket, whose reduction starts while backward is still computing."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from trainyard.parallel.runtime.dp.data_parallel import GradientReducer
from trainyard.parallel.runtime.dp.grad_buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES


class _Ops(TorchDispatchMode):
    """The names of the ops run below autograd, in forward and backward."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _step(model: nn.Module, reducer: GradientReducer, batches: list[torch.Tensor]) -> None:
    reducer.zero_grad()
    for i, x in enumerate(batches):
        if i == len(batches) - 1:
            reducer.arm(0)
        model(x).square().sum().backward()
    reducer.finish()


def test_gradients_land_in_the_buckets_without_zeroing_or_adding():
    model, reference = _model(), _model()
    params = list(model.parameters())
    reducer = GradientReducer([params], None)
    flat = reducer.buckets[0].flat
    batches = [torch.randn(5, 4, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    _step(model, reducer, batches[:1])  # a step before: the buckets hold its gradients
    with _Ops() as ops:
        _step(model, reducer, batches[:1])
    assert "zero_" not in ops.names and "fill_" not in ops.names  # nothing zeroed...
    assert "add_" not in ops.names  # ...nor a first gradient added into zeros
    assert ops.names.count("copy_") == len(params)  # each gradient written into its bucket once
    for p in params:
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    reference(batches[0]).square().sum().backward()
    for p, want in zip(params, reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, want.grad, rtol=0, atol=0)
    # two micro-batches: the second adds into the bucket in place
    _step(model, reducer, batches)
    reference(batches[1]).square().sum().backward()
    for p, want in zip(params, reference.parameters(), strict=True):
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        torch.testing.assert_close(p.grad, want.grad)


def test_a_parameter_without_a_gradient_this_step_is_reduced_as_zeros_not_last_steps():
    model = _model()
    unused = nn.Parameter(torch.ones(3))
    reducer = GradientReducer([[*model.parameters(), unused]], None)
    x = torch.randn(5, 4)
    reducer.zero_grad()
    (model(x).sum() + unused.sum()).backward()
    reducer.finish()
    assert torch.equal(unused.grad, torch.ones(3))
    _step(model, reducer, [x])  # `unused` takes no part in this step
    assert torch.equal(unused.grad, torch.zeros(3))
    assert unused.grad.untyped_storage().data_ptr() == reducer.buckets[0].flat.untyped_storage().data_ptr()


class _StartLog(GradientReducer):
    """Records, as each bucket's reduction starts, how many parameters' gradients of the step have landed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.landed_at_start: list[int] = []

    def _start(self, b) -> None:
        self.landed_at_start.append(sum(x.landed for x in self.buckets))
        super()._start(b)


def test_a_model_under_one_bucket_starts_reducing_its_last_layers_during_backward():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(300, 300) for _ in range(4)])  # 1.4 MiB of fp32: under BUCKET_BYTES
    params = list(model.parameters())
    assert sum(p.numel() * 4 for p in params) < BUCKET_BYTES
    reducer = _StartLog([params], None)
    first = reducer.buckets[0]
    assert len(reducer.buckets) == 2 and sum(p.numel() * 4 for p in first.params) <= FIRST_BUCKET_BYTES
    assert first.params[0] is params[-1]  # the last layer's gradients, final first in backward
    _step(model, reducer, [torch.randn(5, 300)])
    # the first bucket started while the first layers' gradients were still to come; the last at backward's end
    assert reducer.landed_at_start[0] < len(params) and reducer.landed_at_start[-1] == len(params)
