"""The Tinker loss functions the open loop runs (`parallel.runtime.open_loop`), each as Tinker documents it, on one
datum: the log-probability of each target under the current model (`logprobs`, with its gradient) and the datum's
`loss_fn_inputs` besides `target_tokens`. A loss is summed over the datum's tokens (never averaged: the caller
weighs its datums through the inputs). No trainer here: plain torch.

- `cross_entropy`: sum(weights * -logprobs).
- `importance_sampling`: ratio = exp(logprobs - sampling logprobs); -sum(ratio * advantages).
- `ppo`: as importance_sampling with the ratio clipped to [clip_low_threshold, clip_high_threshold] (`loss_fn_config`,
  default 0.8 and 1.2): -sum(min(ratio * advantages, clipped ratio * advantages)).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
}
"""Each loss's `loss_fn_inputs` besides `target_tokens`, each as long as the datum's input."""
CONFIG: dict[str, dict[str, float]] = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}
"""Each loss's `loss_fn_config` keys and their defaults (a loss without an entry takes none)."""

Loss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


def _cross_entropy(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float]
                   ) -> torch.Tensor:
    return -(inputs["weights"] * logprobs).sum()


def _importance_sampling(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float]
                         ) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def _ppo(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


LOSSES: dict[str, Loss] = {"cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling,
                           "ppo": _ppo}
"""The loss functions by Tinker's names."""


def config_of(loss_fn: str, given: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config: its defaults, overridden by `given`; ValueError naming an unknown key."""
    defaults = CONFIG.get(loss_fn, {})
    unknown = sorted(set(given or {}) - set(defaults))
    if unknown:
        raise ValueError(f"loss_fn_config: {loss_fn} takes {', '.join(defaults) or 'no keys'}")
    return {**defaults, **{k: float(v) for k, v in (given or {}).items()}}
