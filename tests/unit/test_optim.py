"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr at the last step."""

import pytest
from trainyard.parallel.config import OptimizerConfig
from trainyard.parallel.optim.optimizer import lr_at


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, total_steps=14) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))


def test_the_optimizer_registry_knows_adamws_state_and_builds_it():
    import torch
    from trainyard.parallel.optim.kinds import OPTIMIZERS, optimizer_kind
    from trainyard.parallel.optim.optimizer import make_optimizer

    cfg = OptimizerConfig(lr=0.5)
    kind = optimizer_kind(cfg)
    assert cfg.kind == "adamw" and kind is OPTIMIZERS["adamw"]
    weight = torch.nn.Parameter(torch.ones(3, 2))
    optimizer = make_optimizer([(weight, weight)], cfg)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 0.5
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    # the names and bytes the registry claims are the state AdamW really keeps
    state = optimizer.state[weight]
    assert set(kind.state) == {k for k, t in state.items() if t.dim() > 0}
    assert kind.state_bytes(weight.numel()) == sum(state[k].numel() * state[k].element_size() for k in kind.state)
    from trainyard.parallel.optim.states import empty_state

    empty = empty_state(kind, optimizer, weight)
    assert set(empty) == set(state) and all(not t.any() for t in empty.values())
