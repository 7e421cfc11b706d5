"""Learning-rate schedules (`optimizer.schedule`), each a function of (step, config, total steps) alone, so the
rate is the same at every layout and after a resume: warm-up from 0 to `lr` over `warmup_steps`, then

- `cosine`: cosine decay to `min_lr_ratio * lr` at the last step;
- `linear`: straight down to `min_lr_ratio * lr` at the last step;
- `constant`: `lr` to the end;
- `wsd` (warm-up, stable, decay: MiniCPM's schedule): `lr` until the last `decay_steps` steps, then straight down
  to `min_lr_ratio * lr` at the last step (`decay_steps` null: the last tenth of the job).

A new schedule is one function, a line in `LR_SCHEDULES` and its name in `parallel.names.LrScheduleName`. (Named
apart from `parallel.plan.schedule.schedules.SCHEDULES`, the pipeline schedules.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

from trainyard.parallel.config import OptimizerConfig
from trainyard.parallel.names import LR_SCHEDULE_NAMES, registry

DEFAULT_DECAY_FRACTION = 0.1
"""wsd without `decay_steps`: the share of the job's steps spent decaying."""


def _progress(step: int, start: int, total_steps: int) -> float:
    """How far `step` is through the decay that starts at `start` and ends at the last step, in [0, 1]."""
    return min(1.0, max(0.0, (step - start) / max(1, total_steps - 1 - start)))


def _cosine(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    progress = _progress(step, cfg.warmup_steps, total_steps)
    return cfg.min_lr_ratio + 0.5 * (1 - cfg.min_lr_ratio) * (1 + math.cos(math.pi * progress))


def _linear(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    return 1 - (1 - cfg.min_lr_ratio) * _progress(step, cfg.warmup_steps, total_steps)


def _constant(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    return 1.0


def _wsd(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    decay = cfg.decay_steps if cfg.decay_steps is not None else math.ceil(DEFAULT_DECAY_FRACTION * total_steps)
    start = max(cfg.warmup_steps, total_steps - 1 - decay)
    return 1 - (1 - cfg.min_lr_ratio) * _progress(step, start, total_steps)


LR_SCHEDULES: dict[str, Callable[[int, OptimizerConfig, int], float]] = registry(LR_SCHEDULE_NAMES, {
    "cosine": _cosine, "linear": _linear, "constant": _constant, "wsd": _wsd,
}, "parallel.optim.lr_schedules.LR_SCHEDULES")
"""`optimizer.schedule` -> the rate after warm-up, as a fraction of `lr`."""


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """The learning rate of step `step` (0-based) of a job of `total_steps` steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * LR_SCHEDULES[cfg.schedule](step, cfg, total_steps)
