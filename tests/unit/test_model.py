"""The GPT: initialisation independent of the layout, and stages that compose into the whole model."""

import torch
from helpers import tiny_spec
from trainyard.parallel.models.whole import GPTStage, full_model
from trainyard.parallel.spec import parse_spec

CFG = parse_spec(tiny_spec(model={"n_layer": 4})).model


def test_stage_parameters_equal_the_full_models_of_the_same_name():
    full = dict(full_model(CFG, seed=5).named_parameters())
    stages = [GPTStage(CFG, [0], first=True, last=False, seed=5), GPTStage(CFG, [1, 2], first=False, last=False,
              seed=5), GPTStage(CFG, [3], first=False, last=True, seed=5)]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(full)
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, full[name]), name


def test_init_depends_on_the_seed():
    a, b = full_model(CFG, seed=1), full_model(CFG, seed=2)
    assert not torch.equal(a.blocks["0"].attn.q.weight, b.blocks["0"].attn.q.weight)


def test_chained_stages_compute_the_full_models_loss():
    tokens = torch.randint(256, (2, 17), generator=torch.Generator().manual_seed(0))
    full = full_model(CFG, seed=5)
    expected = full.loss_sum(full(tokens[:, :-1]), tokens[:, 1:])
    first = GPTStage(CFG, [0, 1], first=True, last=False, seed=5)
    last = GPTStage(CFG, [2, 3], first=False, last=True, seed=5)
    got = last.loss_sum(last(first(tokens[:, :-1])), tokens[:, 1:])
    torch.testing.assert_close(got, expected)


def test_tied_embeddings_share_one_tensor():
    cfg = parse_spec(tiny_spec(model={"tie_embeddings": True})).model
    model = full_model(cfg, seed=0)
    assert model.lm_head.weight is model.wte.weight


def test_the_activation_meter_counts_a_storage_once_however_many_layers_save_it():
    from torch import nn
    from trainyard.parallel.runtime.pipeline.pipeline import _SavedTensorMeter

    layers = [nn.Linear(8, 8) for _ in range(3)]  # like q, k and v: each saves the same input
    meter = _SavedTensorMeter([p for layer in layers for p in layer.parameters()])
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        outs = [layer(x) for layer in layers]
    assert meter.peak == meter.live == x.numel() * x.element_size()  # weights are parameters: not counted
    sum(o.sum() for o in outs).backward()
    del outs
    assert meter.live == 0
