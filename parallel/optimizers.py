"""The optimizer registry: each optimizer's per-parameter state and its bytes, and how to build it.

`optimizer.kind` in the spec picks an entry. The memory plan asks it how many bytes of state a parameter
costs (`parallel.memory`), the trainer and the checkpoint which tensors it keeps per parameter (saved as
the parameter's moments, under the same names in every layout), and `parallel.optim.make_optimizer` builds
it. 8-bit or factored states and offload are new entries with their own bytes and state names.
Pure at import (the plan reads this without torch); `build` imports torch when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainyard.parallel.config import OptimizerConfig

if TYPE_CHECKING:
    import torch

FP32 = 4


def _build_adamw(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    import torch  # here, not at the top: the plan and the API read the registry without loading torch

    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)


def _empty_adamw_state(t: torch.Tensor) -> dict[str, torch.Tensor]:
    import torch

    return {"step": torch.tensor(0.0), **{k: torch.zeros_like(t, memory_format=torch.preserve_format)
                                          for k in ADAMW.state}}


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    state: tuple[str, ...]
    """The tensors it keeps per parameter, each shaped like the parameter (besides a scalar step count)."""
    state_bytes_per_element: int
    """Bytes of all of `state` per parameter element."""
    build: Callable[[list[dict], OptimizerConfig], torch.optim.Optimizer]
    """Builds it over parameter groups (`{"params": [...], "weight_decay": ...}`) with the spec's settings."""
    empty_state: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    """The state it would create for tensor `t` at its first step (a checkpoint before it, or a load,
    needs the state to exist)."""

    def state_bytes(self, elements: int) -> int:
        """Bytes of state for `elements` parameter elements."""
        return self.state_bytes_per_element * elements


ADAMW = OptimizerKind(name="adamw", state=("exp_avg", "exp_avg_sq"), state_bytes_per_element=2 * FP32,
                      build=_build_adamw, empty_state=_empty_adamw_state)

OPTIMIZERS: dict[str, OptimizerKind] = {"adamw": ADAMW}


def optimizer_kind(cfg: OptimizerConfig) -> OptimizerKind:
    try:
        return OPTIMIZERS[cfg.kind]
    except KeyError:
        raise ValueError(f"no optimizer {cfg.kind!r}; known: {sorted(OPTIMIZERS)}") from None
