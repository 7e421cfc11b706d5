"""The Tinker losses (`parallel.runtime.tinker.losses`) against references written here from Tinker's documented
formulas (https://tinker-docs.thinkingmachines.ai/losses and its pages per loss): each loss's value, and its gradient
with respect to the current logprobs, derived by hand from the formula (not by autograd of the same expression).
Plain torch, in float64; the ratios are drawn well inside and outside the clips, never on their edges. And how the
open loop groups a call's datums into forwards (`open_loop.batches`)."""

from __future__ import annotations

import pytest
import torch
from trainyard.parallel.runtime.tinker.losses import CONFIG, INPUTS, LOSSES, config_of

N = 64


def _case(seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(N, generator=g, dtype=torch.float64) * 4  # in (-4, 0]
    sampled = logprobs + (torch.rand(N, generator=g, dtype=torch.float64) * 2.4 - 1.2)  # ratios e^-1.2 .. e^1.2
    inputs = {"logprobs": sampled, "advantages": torch.randn(N, generator=g, dtype=torch.float64),
              "weights": torch.randn(N, generator=g, dtype=torch.float64)}
    return logprobs, inputs


def _value_and_grad(loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
                    config: dict[str, float] | None = None) -> tuple[float, torch.Tensor]:
    lp = logprobs.clone().requires_grad_(True)
    loss = LOSSES[loss_fn](lp, {k: inputs[k] for k in INPUTS[loss_fn]}, config_of(loss_fn, config))
    loss.backward()
    assert lp.grad is not None
    return float(loss.detach()), lp.grad


def _not_on_an_edge(ratio: torch.Tensor, *edges: float) -> None:
    for edge in edges:
        assert (ratio - edge).abs().min() > 1e-6  # a tie between the branches has no one gradient


@pytest.mark.parametrize("seed", [0, 1])
def test_each_loss_is_its_documented_formula_with_its_gradient(seed):
    lp, inp = _case(seed)
    q, adv, w = inp["logprobs"], inp["advantages"], inp["weights"]
    ratio = torch.exp(lp - q)

    value, grad = _value_and_grad("cross_entropy", lp, inp)  # -sum(weights * logprobs)
    assert value == pytest.approx(float(-(w * lp).sum()), rel=1e-12)
    torch.testing.assert_close(grad, -w, rtol=1e-12, atol=0)

    value, grad = _value_and_grad("importance_sampling", lp, inp)  # -sum(p/q * A)
    assert value == pytest.approx(float(-(ratio * adv).sum()), rel=1e-12)
    torch.testing.assert_close(grad, -ratio * adv, rtol=1e-12, atol=0)

    for low, high, given in ((0.8, 1.2, None), (0.5, 2.0, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})):
        _not_on_an_edge(ratio, low, high)
        value, grad = _value_and_grad("ppo", lp, inp, given)  # -sum(min(r A, clip(r) A))
        clipped = ratio.clamp(low, high)
        assert value == pytest.approx(float(-torch.minimum(ratio * adv, clipped * adv).sum()), rel=1e-12)
        # d/dlp: the unclipped branch's -r A where it is the smaller; the clipped one is a constant past the clip
        takes_unclipped = (ratio * adv < clipped * adv) | ((ratio > low) & (ratio < high))
        torch.testing.assert_close(grad, torch.where(takes_unclipped, -ratio * adv, torch.zeros_like(adv)),
                                   rtol=1e-12, atol=0)
        assert bool((~takes_unclipped).any()) and bool(takes_unclipped.any())  # both branches are seen

    for low, high, given in ((0.0, 4.0, None), (0.8, 1.2, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})):
        value, grad = _value_and_grad("cispo", lp, inp, given)  # -sum(sg(clip(r)) * logprobs * A)
        clipped = ratio.clamp(low, high)
        assert value == pytest.approx(float(-(clipped * lp * adv).sum()), rel=1e-12)
        torch.testing.assert_close(grad, -clipped * adv, rtol=1e-12, atol=0)  # the ratio carries no gradient

    for beta in (0.05, 1.5):
        value, grad = _value_and_grad("dro", lp, inp, {"beta": beta})  # -sum(lp A - beta/2 (lp - q)^2)
        assert value == pytest.approx(float(-(lp * adv - 0.5 * beta * (lp - q) ** 2).sum()), rel=1e-12)
        torch.testing.assert_close(grad, -(adv - beta * (lp - q)), rtol=1e-12, atol=1e-15)


def test_a_cispo_ratio_past_its_clip_still_gives_its_token_a_gradient():
    """CISPO's defining difference from PPO (the docs' "never zeros a token's gradient"): far past the clip, PPO's
    gradient is zero, CISPO's is the clipped ratio times the advantage."""
    lp = torch.tensor([-1.0], dtype=torch.float64)
    inp = {"logprobs": torch.tensor([-3.0], dtype=torch.float64),
           "advantages": torch.tensor([2.0], dtype=torch.float64)}
    _, ppo = _value_and_grad("ppo", lp, inp)
    _, cispo = _value_and_grad("cispo", lp, inp, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    assert float(ppo) == 0.0 and float(cispo) == pytest.approx(-1.2 * 2.0)


def test_configs_are_checked_naming_the_key():
    assert config_of("cispo", None) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert config_of("ppo", {"clip_high_threshold": 1.5}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.5}
    with pytest.raises(ValueError, match=r"^loss_fn_config\.beta: dro needs it"):
        config_of("dro", None)
    with pytest.raises(ValueError, match=r"^loss_fn_config: cross_entropy takes no keys"):
        config_of("cross_entropy", {"beta": 1.0})
    with pytest.raises(ValueError, match=r"^loss_fn_config: dro takes beta"):
        config_of("dro", {"beta": 1.0, "clip_low_threshold": 0.5})
    with pytest.raises(ValueError, match=r"^loss_fn_config\.beta: not a finite number"):
        config_of("dro", {"beta": float("nan")})
    assert set(CONFIG) <= set(LOSSES) == set(INPUTS)


def test_a_calls_datums_go_in_forwards_of_at_most_the_micro_batchs_positions():
    from trainyard.parallel.runtime.open_loop import batches

    assert batches([], 64) == []
    assert batches([16, 16, 16, 16, 16], 64) == [range(0, 4), range(4, 5)]  # 4 rows x 16
    assert batches([10, 30, 5], 64) == [range(0, 2), range(2, 3)]  # 3 x 30 > 64: the third waits
    assert batches([100, 3, 3], 64) == [range(0, 1), range(1, 3)]  # one datum alone may fill a forward
    assert [i for r in batches([7, 1, 40, 9, 9, 33], 50) for i in r] == list(range(6))  # every datum once, in order
