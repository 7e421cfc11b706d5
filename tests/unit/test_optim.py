"""Learning-rate schedules (linear warm-up, then cosine, linear, constant or wsd) and the optimizer registry."""

import math

import pytest
from trainyard.parallel.config import OptimizerConfig
from trainyard.parallel.optim.lr_schedules import lr_at


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, total_steps=14) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))


def test_each_schedule_after_the_same_warm_up():
    from trainyard.parallel.optim.lr_schedules import LR_SCHEDULES

    def lrs(**kw) -> list[float]:
        cfg = OptimizerConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1, **kw)
        return [lr_at(s, cfg, total_steps=12) for s in range(12)]

    assert set(LR_SCHEDULES) == {"cosine", "linear", "constant", "wsd"}
    assert lrs(schedule="constant") == [0.5] + [1.0] * 11
    linear = lrs(schedule="linear")
    assert linear[:3] == [0.5, 1.0, 1.0] and linear[-1] == pytest.approx(0.1)
    assert [round(b - a, 9) for a, b in zip(linear[2:], linear[3:], strict=False)] == [-0.1] * 9  # one straight line
    wsd = lrs(schedule="wsd", decay_steps=3)
    assert wsd[:9] == [0.5] + [1.0] * 8  # stable until the last three steps' decay
    assert wsd[9:] == pytest.approx([0.7, 0.4, 0.1])
    assert lrs(schedule="wsd")[-3:] == pytest.approx([1.0, 0.55, 0.1])  # null: the last tenth (two steps of 12)
    cosine = lrs()
    assert cosine == lrs(schedule="cosine") and cosine[6] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 4 / 9)))


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
