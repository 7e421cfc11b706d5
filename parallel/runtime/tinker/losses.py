"""The Tinker loss functions the open loop runs (`parallel.runtime.open_loop`), each as Tinker documents it, on one
datum: the log-probability of each target under the current model (`logprobs`, with its gradient) and the datum's
`loss_fn_inputs` besides `target_tokens`. A loss is summed over the datum's tokens (never averaged: the caller
weighs its datums through the inputs). No trainer here: plain torch.

The formulas, inputs and `loss_fn_config` keys are Tinker's documentation's: "Loss functions in Tinker"
(https://tinker-docs.thinkingmachines.ai/losses, the cookbook's docs/losses.mdx) and its pages per loss
(https://tinker-docs.thinkingmachines.ai/tinker/losses/cispo, .../dro). `q` below is the sampler's logprob (the
`logprobs` input), `A` the `advantages` input; every loss answers `logprobs` (the current model's) per datum and
`loss:sum`.

- `cross_entropy`: sum(weights * -logprobs). Inputs: `weights`.
- `importance_sampling`: ratio = exp(logprobs - q); -sum(ratio * A).
- `ppo`: as importance_sampling with the ratio clipped to [clip_low_threshold, clip_high_threshold] (default 0.8 and
  1.2, the docs' epsilon of 0.2): -sum(min(ratio * A, clipped ratio * A)).
- `cispo`: the clipped ratio, detached, weighs the logprob: -sum(sg(clip(ratio, low, high)) * logprobs * A); the
  thresholds default to the docs' one-sided clip, clip_low_threshold 0.0 and clip_high_threshold 4.0.
- `dro`: -sum(logprobs * A - 0.5 * beta * (logprobs - q)^2); `beta` is required (the docs give no default).

Not served (refused naming `loss_fn`): `gspo` and `stable_reinforce`, whose documented inputs and defaults are not
pinned down here, and `custom` (a loss uploaded with `create_custom_loss`). `forward_backward_custom` needs none of
them: the SDK computes the user's loss itself and sends a `cross_entropy` with its gradient as the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}
"""Each loss's `loss_fn_inputs` besides `target_tokens`, each as long as the datum's input."""
CONFIG: dict[str, dict[str, float | None]] = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": None},
}
"""Each loss's `loss_fn_config` keys and their defaults (None: required; a loss without an entry takes none)."""

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


def _cispo(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    ratio = torch.exp(logprobs - inputs["logprobs"])
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -(clipped * logprobs * inputs["advantages"]).sum()


def _dro(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    quadratic = (logprobs - inputs["logprobs"]) ** 2
    return -(logprobs * inputs["advantages"] - 0.5 * config["beta"] * quadratic).sum()


LOSSES: dict[str, Loss] = {"cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling,
                           "ppo": _ppo, "cispo": _cispo, "dro": _dro}
"""The loss functions by Tinker's names."""


def config_of(loss_fn: str, given: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config: its defaults, overridden by `given`; ValueError naming an unknown, missing or non-finite
    key."""
    defaults = CONFIG.get(loss_fn, {})
    unknown = sorted(set(given or {}) - set(defaults))
    if unknown:
        raise ValueError(f"loss_fn_config: {loss_fn} takes {', '.join(defaults) or 'no keys'}")
    full = {**defaults, **{k: float(v) for k, v in (given or {}).items()}}
    for key, value in full.items():
        if value is None:
            raise ValueError(f"loss_fn_config.{key}: {loss_fn} needs it (Tinker documents no default)")
        if not math.isfinite(value):
            raise ValueError(f"loss_fn_config.{key}: not a finite number")
    return {k: float(v) for k, v in full.items() if v is not None}
