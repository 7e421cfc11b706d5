"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr at the last step."""

import pytest

from parallel.config import OptimizerConfig
from parallel.optim import lr_at


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, total_steps=14) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
