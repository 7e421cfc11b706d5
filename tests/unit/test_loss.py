"""The loss fused with the head (`parallel.models.components.loss`): torch's cross-entropy in value and gradients, and
no full-size fp32 logits tensor in its forward or backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.components.loss import IGNORE_INDEX, chunk_tokens, linear_cross_entropy_sum
from trainyard.parallel.models.whole import full_model

TOKENS, D, VOCAB = 300, 48, 1000


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(TOKENS, D, generator=gen), torch.randn(VOCAB, D, generator=gen) * 0.3
    targets = torch.randint(VOCAB, (TOKENS,), generator=gen)
    targets[::7] = IGNORE_INDEX
    return hidden, weight, targets


def _loss_and_grads(loss_fn, bf16: bool) -> list[torch.Tensor]:
    hidden, weight, targets = (t.requires_grad_(t.is_floating_point()) for t in _inputs())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = loss_fn(hidden, weight, targets)
    (loss * 0.37).backward()  # the trainer scales the summed loss: the gradient is not 1
    return [loss.detach(), hidden.grad, weight.grad]


def _torchs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_fused_loss_and_its_gradients_equal_torchs_cross_entropy(bf16):
    expected = _loss_and_grads(_torchs, bf16)
    # 64 tokens a chunk: five chunks, the last one short
    got = _loss_and_grads(lambda h, w, t: linear_cross_entropy_sum(h, w, t, chunk=64), bf16)
    loss_tol, grad_tol = (1e-6, 1e-5) if not bf16 else (1e-3, 2e-2)
    torch.testing.assert_close(got[0], expected[0], rtol=loss_tol, atol=0)
    for g, e in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(g, e, rtol=grad_tol, atol=grad_tol * float(e.abs().max()))


def test_without_gradients_the_fused_loss_is_the_same_and_keeps_nothing():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        got = linear_cross_entropy_sum(hidden, weight, targets)
    assert got.grad_fn is None
    torch.testing.assert_close(got, _torchs(hidden, weight, targets), rtol=1e-6, atol=0)


class _WidestLogits(TorchDispatchMode):
    """Every fp32 tensor as wide as the vocabulary that any op makes (outputs of every op below autograd, in
    forward and in backward, views included): the most rows one had. A (tokens, vocab) fp32 logits tensor,
    or its log-softmax or gradient, would have all the tokens' rows."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_stages_loss_holds_no_full_fp32_logits_in_forward_or_backward(bf16):
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, vocab_size=512, seq_len=32)
    model = full_model(cfg, seed=0)
    tokens = torch.randint(cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    n = tokens[:, 1:].numel()
    hidden = model(tokens[:, :-1]).detach().requires_grad_()

    def rows_of(loss_fn) -> int:
        with _WidestLogits(cfg.vocab_size) as seen:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(hidden, tokens[:, 1:])
            loss.backward()
        return seen.rows

    # The recorder sees torch's own path make whole (tokens, vocab) fp32 tensors...
    assert rows_of(lambda h, t: _torchs(model.ln_f(h).flatten(0, 1), model.lm_head.weight, t.flatten())) == n
    # ...and the stage's loss none wider than a chunk, a fraction of the tokens.
    assert rows_of(model.loss_sum) <= chunk_tokens(n, cfg.vocab_size, cfg.d_model) == n // 4
