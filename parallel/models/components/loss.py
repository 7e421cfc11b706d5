"""The language-model loss fused with the output projection, in chunks of tokens: no full-size fp32 logits.

`linear_cross_entropy_sum(hidden, weight, targets)` is `F.cross_entropy(F.linear(hidden, weight).float(),
targets, reduction="sum", ignore_index=-100)` in value and gradients, but the (tokens, vocab) logits are made a
chunk of tokens at a time, upcast and reduced in fp32, and dropped before the next chunk. Torch's own path holds
the whole logits tensor in the compute dtype, its fp32 copy, and the fp32 log-softmax it saves for backward
(at GPT-2 medium's 16 x 1024 tokens and 50,304 words, 3.3 GB for each fp32 one).

Written by hand (a custom autograd Function) because torch has no fused linear cross-entropy, and chunking with
`torch.utils.checkpoint` would recompute every chunk's logits in backward (one more head matmul a step). As
Liger-Kernel's fused linear cross-entropy does, the gradients are computed in forward, where each chunk's
logits exist anyway: the loss is the graph's end, so its gradient is a scalar `g` that only scales them.
Backward returns `g x` the stored gradients of the hidden states (tokens, d_model) and of the weight (vocab,
d_model, fp32): what is kept for backward is that, never logits. Per chunk:

    logp = log_softmax(fp32(h W^T));  loss -= sum(logp[target])  (as torch's cross_entropy: log_softmax, nll)
    dlogits = exp(logp) - onehot(target), in place;  dh = dlogits W;  dW += dlogits^T h

(an ignored target's row counts nothing: its loss term is masked, its hidden state zeroed for dW and its dh row
zeroed at the end, passes d_model wide rather than vocabulary wide).

Chunks hold `chunk_tokens` tokens: about d_model, at least enough to cover the tokens in ceil(vocab / d_model)
chunks (Liger's rule). A chunk's fp32 logits are then no bigger than the head's weight (or the hidden states),
which the step holds anyway. dW accumulates in fp32 across chunks (summed in bf16 it would lose the precision
one bf16 matmul keeps); under bf16 autocast each chunk's bf16 product is added into it, one more pass over a
(vocab, d_model) tensor per chunk. (On a GPU a matmul that accumulates into fp32, as Liger's kernel does, would
save that pass: not written here, where no GPU could test it.)

The trade: each micro-batch in flight keeps an fp32 (vocab, d_model) weight gradient instead of the fp32
(tokens, vocab) log-softmax (less whenever a micro-batch has more tokens than d_model), and a call issues
about twice torch's ops (62 against 32 on a 2-chunk toy head), which only a model too small to fill the
device pays for (on CPU: 416 against 282 us at vocab 256, d_model 64, 128 tokens; even at vocab 8192).

In a split backward (zero-bubble schedules, `parallel.runtime.pipeline.split_backward`) this node is where the head's
weight meets the input's path: both halves run its backward, and it keeps its gradients until the weight half.

Not used for a vocabulary-parallel head (tensor parallelism): its logits are a DTensor sharded over the
vocabulary and `loss_parallel` computes the loss; no rank then holds more than vocab / tp of them (see
`DecoderStage.loss_sum`).
"""

from __future__ import annotations

import torch
from trainyard.parallel.models.counting import chunk_tokens

IGNORE_INDEX = -100
"""A target the loss does not count (torch's cross_entropy default)."""


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             chunk: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` against `targets` (ignore_index -100), an fp32 scalar.
    `hidden` (..., d_model), `weight` (vocab, d_model), `targets` hidden's leading shape. The matmuls run in
    the autocast dtype when autocast is on (as `F.linear` would), else in `hidden`'s; `chunk` tokens at a
    time (default `chunk_tokens`)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    grads = torch.is_grad_enabled()
    if chunk is None:
        chunk = chunk_tokens(hidden.shape[0], weight.shape[0], weight.shape[1])
    return _LinearCrossEntropy.apply(hidden, weight, targets.reshape(-1), dtype, chunk,
                                     grads and hidden.requires_grad, grads and weight.requires_grad)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
                chunk: int, grads_h: bool, grads_w: bool) -> torch.Tensor:
        # Every operand is cast to `dtype` (the autocast dtype when autocast is on) by hand, so autocast, if
        # on, has nothing to change here.
        w = weight.to(dtype)
        w_t = w.t()
        h_all = hidden.to(dtype)
        counted = (targets != IGNORE_INDEX).unsqueeze(1)
        safe = targets.clamp_min(0).unsqueeze(1)  # any index for an ignored target (-100): its row is masked
        picked = torch.empty(safe.shape, dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if grads_h else None
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) if grads_w else None
        # An ignored token's row of the logits' gradient is zero: left out of dW by zeroing its hidden state here,
        # and out of dh by zeroing its row at the end (two d_model-wide passes, not a vocabulary-wide one).
        h_counted = h_all * counted if grads_w else None
        minus_one = torch.full((min(chunk, hidden.shape[0]), 1), -1.0, device=hidden.device)
        # One chunk's vocabulary-wide tensors alive at a time (`del` before the next chunk's: a name still bound
        # to the last chunk's kept its fp32 log-probabilities and bf16 gradient through the next one's logits).
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logp = torch.log_softmax((h_all[rows] @ w_t).float(), 1)  # the chunk's logits, in fp32
            torch.gather(logp, 1, safe[rows], out=picked[rows])
            if not (grads_h or grads_w):
                del logp
                continue
            probs = logp.exp_()  # in place: the chunk's softmax, then its gradient (softmax - onehot)
            probs.scatter_add_(1, safe[rows], minus_one[:probs.shape[0]])
            low = probs.to(dtype)
            del logp, probs  # the fp32 gradient, once low is its bf16 copy (in fp32 low is the same tensor)
            if grad_h is not None and dtype == hidden.dtype:
                torch.mm(low, w, out=grad_h[rows])
            elif grad_h is not None:
                grad_h[rows] = low @ w
            if grad_w is not None and h_counted is not None:  # both exist exactly when the weight needs a grad
                _accumulate(grad_w, low.t(), h_counted[rows], first=start == 0)
            del low
        if grad_h is not None:
            grad_h.mul_(counted)
        loss = -(picked * counted).sum()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad_loss,
                None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None, None, None)


def _accumulate(grad_w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """grad_w (fp32) = a @ b on the first chunk, += after: in place when a and b are fp32, else their product
    (in their dtype) added in fp32."""
    if a.dtype == grad_w.dtype:
        if first:
            torch.mm(a, b, out=grad_w)
        else:
            grad_w.addmm_(a, b)
    elif first:
        grad_w.copy_(a @ b)
    else:
        grad_w.add_(a @ b)
