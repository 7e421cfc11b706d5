"""The MoE layer on one rank: routing, capacity, the auxiliary losses against their closed forms, and the
model's MoE blocks (which blocks, which experts, parameter names)."""

import math

import pytest
import torch
from helpers import tiny_spec
from trainyard.parallel.config import ModelConfig, MoEConfig
from trainyard.parallel.models import family_of
from trainyard.parallel.models.components.moe import MoELayer, capacity
from trainyard.parallel.models.whole import GPTStage, full_model
from trainyard.parallel.spec import parse_spec

E, D, T = 4, 4, 8


def layer(top_k: int = 1, capacity_factor: float | None = None, aux: float = 0.0, z: float = 0.0) -> MoELayer:
    """A layer whose router is the identity (d_model = experts), so a token's logits are the token itself."""
    cfg = ModelConfig(n_layer=1, n_head=1, d_model=D, seq_len=T, moe=MoEConfig(
        experts=E, top_k=top_k, every=1, capacity_factor=capacity_factor, aux_loss_coef=aux, z_loss_coef=z))
    moe = MoELayer(cfg, range(E), family_of(cfg).feed_forward)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(E))
    return moe


def tokens(experts: list[int], scale: float = 5.0) -> torch.Tensor:
    """One sequence whose token i prefers expert experts[i] (a one-hot logit of `scale`)."""
    return torch.nn.functional.one_hot(torch.tensor(experts), E).float().unsqueeze(0) * scale


def expert_out(moe: MoELayer, e: int, x: torch.Tensor) -> torch.Tensor:
    return moe.experts[str(e)](x)


def test_capacity_is_per_sequence_and_rounds_up():
    cfg = ModelConfig(n_layer=2, n_head=1, d_model=8, seq_len=10, moe=MoEConfig(experts=4, top_k=2,
                                                                                 capacity_factor=1.0))
    assert capacity(cfg) == math.ceil(1.0 * 10 * 2 / 4) == 5
    assert capacity(ModelConfig(**{**cfg.__dict__, "moe": MoEConfig(experts=4)})) is None  # dropless by default


def test_over_capacity_tokens_skip_the_expert_earlier_positions_first():
    # Capacity 2 per expert: six tokens want expert 0, one expert 1, one expert 3.
    moe = layer(capacity_factor=1.0)
    x = tokens([0, 0, 1, 0, 0, 3, 0, 0])
    y = moe(x)
    kept = [0, 1, 2, 5]  # the first two of expert 0, and the only ones of experts 1 and 3
    dropped = [3, 4, 6, 7]
    assert torch.equal(y[0, dropped], torch.zeros(4, D))  # dropped tokens get nothing (their residual carries them)
    for i in kept:  # top_k=1: the renormalised gate weight is exactly 1
        torch.testing.assert_close(y[0, i], expert_out(moe, int(x[0, i].argmax()), x[0, i]))
    stats = moe.summarize(moe.stats, sequences=1)
    assert stats["dropped_fraction"] == 4 / 8
    assert stats["load"] == [6, 1, 0, 1]  # load counts every token routed, dropped or not


def test_dropless_keeps_every_token():
    moe = layer(capacity_factor=None)
    x = tokens([0] * T)
    y = moe(x)
    torch.testing.assert_close(y[0], expert_out(moe, 0, x[0]))
    assert moe.summarize(moe.stats, sequences=1)["dropped_fraction"] == 0.0


def test_top2_weights_are_renormalised_over_the_chosen_experts():
    moe = layer(top_k=2)
    x = torch.tensor([[[3.0, 1.0, -2.0, 0.0]]])  # chooses experts 0 and 1
    p = torch.softmax(x[0, 0], -1)
    w0, w1 = p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1])
    expected = w0 * expert_out(moe, 0, x[0, 0]) + w1 * expert_out(moe, 1, x[0, 0])
    torch.testing.assert_close(moe(x)[0, 0], expected)


def test_second_choices_count_against_capacity_too():
    # top_k=2 over 4 experts, T=8, factor 0.5: capacity ceil(0.5*8*2/4) = 2 per expert. Every token prefers
    # expert 0 then expert 1: both keep positions 0 and 1 only.
    moe = layer(top_k=2, capacity_factor=0.5)
    x = torch.tensor([[3.0, 2.0, 0.0, 0.0]]).repeat(T, 1).unsqueeze(0)
    y = moe(x)
    assert torch.equal(y[0, 2:], torch.zeros(T - 2, D))
    assert moe.summarize(moe.stats, sequences=1)["dropped_fraction"] == 12 / 16


def closed_form_losses(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Switch/GShard load balancing (E * sum_e f_e P_e, mean over sequences) and the router z-loss, by hand."""
    aux = []
    for seq in logits:
        p = seq.softmax(-1)
        chosen = p.topk(top_k, -1).indices
        f = torch.stack([(chosen == e).any(-1).float().mean() / top_k for e in range(E)])
        aux.append(E * (f * p.mean(0)).sum())
    z = torch.logsumexp(logits, -1).pow(2).mean()
    return torch.stack(aux).mean(), z


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_and_z_losses_equal_their_closed_forms(top_k):
    x = torch.randn(3, T, D, generator=torch.Generator().manual_seed(0)) * 2
    moe = layer(top_k=top_k)
    moe(x)
    aux, z = closed_form_losses(x, top_k)
    stats = moe.summarize(moe.stats, sequences=3)
    assert stats["aux_loss"] == pytest.approx(float(aux), rel=1e-6)
    assert stats["z_loss"] == pytest.approx(float(z), rel=1e-6)
    assert sum(stats["load"]) == 3 * T * top_k


def test_perfect_balance_gives_an_aux_loss_of_one():
    moe = layer()
    moe(tokens([0, 1, 2, 3, 0, 1, 2, 3], scale=50.0))  # probabilities one-hot: P_e = f_e = 1/4
    assert moe.summarize(moe.stats, sequences=1)["aux_loss"] == pytest.approx(1.0, rel=1e-6)


def test_aux_losses_reach_the_router_through_backward():
    # The gradient the block's output carries back adds the weighted losses' gradient to the router's.
    x = torch.randn(2, T, D, generator=torch.Generator().manual_seed(1))
    coefs = {"aux": 0.5, "z": 0.1}
    moe = layer(top_k=2, **coefs)
    (moe(x) * 0).sum().backward()  # only the auxiliary losses have a gradient
    weight = moe.router.weight.detach().clone().requires_grad_()
    aux, z = closed_form_losses(x @ weight.T, top_k=2)
    (coefs["aux"] * aux + coefs["z"] * z).backward()
    assert weight.grad.abs().max() > 0
    torch.testing.assert_close(moe.router.weight.grad, weight.grad)


MOE_CFG = parse_spec(tiny_spec(model={"n_layer": 4, "moe": {"experts": 4, "every": 2}})).model


def test_every_second_block_is_moe_and_experts_are_named_by_global_index():
    model = full_model(MOE_CFG, seed=3)
    assert MOE_CFG.moe_blocks == [1, 3]
    assert hasattr(model.blocks["1"], "moe") and hasattr(model.blocks["0"], "mlp")
    assert sorted(model.blocks["3"].moe.experts) == ["0", "1", "2", "3"]
    assert "blocks.3.moe.experts.2.fc.weight" in dict(model.named_parameters())


def test_a_stage_hosting_some_experts_has_the_full_models_weights_for_them():
    full = dict(full_model(MOE_CFG, seed=3).named_parameters())
    part = GPTStage(MOE_CFG, [2, 3], first=False, last=True, seed=3, experts=[2, 3])
    names = dict(part.named_parameters())
    assert sorted(part.blocks["3"].moe.experts) == ["2", "3"]
    assert not any(".experts.0." in n or ".experts.1." in n for n in names)
    for name, p in names.items():
        assert torch.equal(p, full[name]), name


@pytest.mark.parametrize(("family", "capacity_factor"), [("gpt2", None), ("llama", 1.0)],
                         ids=["gpt2-dropless", "llama-capacity"])
def test_grouped_experts_equal_the_loop(family, capacity_factor):
    # torch._grouped_mm's CPU fallback (fp32) runs the grouped path here; on a GPU it serves Hopper in bf16 only.
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=T, family=family, moe=MoEConfig(
        experts=E, top_k=2, every=1, capacity_factor=capacity_factor))
    torch.manual_seed(0)
    loop = MoELayer(cfg, range(E), family_of(cfg).feed_forward)
    grouped = MoELayer(cfg, range(E), family_of(cfg).feed_forward)
    grouped.load_state_dict(loop.state_dict())
    loop.grouped_mm, grouped.grouped_mm = False, True
    x = torch.randn(3, T, 16)
    probe = torch.randn(3, T, 16)
    outs = []
    for moe in (loop, grouped):
        xi = x.clone().requires_grad_()
        y = moe(xi)
        (y * probe).sum().backward()
        outs.append((y, xi.grad, {n: p.grad for n, p in moe.named_parameters()}))
    (y0, g0, p0), (y1, g1, p1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
    assert p0.keys() == p1.keys()
    for name in p0:
        torch.testing.assert_close(p1[name], p0[name], rtol=1e-5, atol=1e-6, msg=name)
