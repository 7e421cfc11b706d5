"""Adafactor (Shazeer & Stern 2018) as transformer training uses it: no first moment, no relative step.

The update is HF transformers' `Adafactor(relative_step=False, warmup_init=False, beta1=None)` (fairseq's),
step for step, with HF's `scale_parameter` (True as `optimizer.kind: adafactor` builds it):

    t += 1;  beta2_t = 1 - t^decay_rate (decay_rate -0.8);  G = grad^2 + eps1
    matrix (the last two dimensions): R <- beta2_t R + (1 - beta2_t) mean_cols(G)   (row_var, rows x 1)
                                      C <- beta2_t C + (1 - beta2_t) mean_rows(G)   (col_var, 1 x cols)
                                      U = grad / sqrt(R C / mean(R))   (R / mean(R) at least fp32's
                                          smallest normal: where it underflows to 0, HF's class makes NaN)
    vector:                           V <- beta2_t V + (1 - beta2_t) G;  U = grad / sqrt(V)
    U /= max(1, RMS(U) / d)   (update clipping, d = 1)
    a = lr x max(eps2, RMS(p)) with scale_parameter, else lr;  p -= a wd p;  p -= a U

so the state of a matrix is its row and column second moments, O(rows + cols), and `lr` is set by the job's
schedule (warm-up, cosine) as AdamW's is; weight decay is decoupled (a x wd). The names and shapes of the
state are torch's `Adafactor`'s (step, row_var and col_var with the reduced dimension kept, variance for a
vector), which `parallel.optim.states` exports and loads.

Why scale_parameter: on the demo job at 400 steps the plain lr did best at 1e-3, far above AdamW's loss (a sweep
by hand, not a committed row); the parameter-relative step reached AdamW's loss (at lr 0.07): with it
LayerNorm gains (RMS 1) move fast and zero-initialised biases slowly, as Adafactor's authors meant.

Written by hand because torch's `torch.optim.Adafactor` cannot be configured into it: its step is always
relative with lr capped at 1/sqrt(t) on top of the schedule (37% above AdamW at its best lr, 0.1); HF's
class is this update but lives in transformers (a test dependency only, a heavy import in every rank) and
keeps a Python-int step and squeezed factors. tests/unit/test_optimizer_kinds.py checks it against HF's
class step for step, with and without scale_parameter.
"""

from __future__ import annotations

import torch
from trainyard.parallel.optim.dynamo_free import DynamoFree

_TINY = torch.finfo(torch.float32).tiny


class Adafactor(DynamoFree):
    """Factored second moments, update clipping, a plain lr, no first moment (module doc)."""

    def __init__(self, params, lr: float = 1e-3, eps: tuple[float, float] = (1e-30, 1e-3), d: float = 1.0,
                 decay_rate: float = -0.8, weight_decay: float = 0.0, scale_parameter: bool = False):
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        super().__init__(params, {"lr": lr, "eps": eps, "d": d, "decay_rate": decay_rate,
                                  "weight_decay": weight_decay, "scale_parameter": scale_parameter})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            eps1, wd = group["eps"][0], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                lr = group["lr"]
                if group["scale_parameter"]:  # HF's option: the step relative to the parameter's RMS
                    # A device tensor (read as a float it made a host read per tensor per step), in float64 as the
                    # Python float was: the same bits.
                    lr = (p.float().norm(2) / p.numel() ** 0.5).double().clamp_(min=group["eps"][1]) * lr
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state.update(empty_state(p))
                state["step"] += 1
                beta2 = 1.0 - float(state["step"]) ** group["decay_rate"]
                square = grad.square().add_(eps1)
                if grad.dim() >= 2:
                    row, col = state["row_var"], state["col_var"]
                    row.mul_(beta2).add_(square.mean(dim=-1, keepdim=True), alpha=1.0 - beta2)
                    col.mul_(beta2).add_(square.mean(dim=-2, keepdim=True), alpha=1.0 - beta2)
                    # A row of zero gradients (an embedding's absent tokens) holds only eps1; beside rows of large
                    # ones (a mean over ~1e15, without grad_clip) its ratio underflows to 0, whose rsqrt, inf, times
                    # its zero gradient made the whole matrix NaN (HF's class too). The smallest normal float keeps
                    # the ratio of every finite state, and the clip below bounds what it gives.
                    ratio = (row / row.mean(dim=-2, keepdim=True)).clamp_(min=_TINY)
                    update = ratio.rsqrt_() * col.rsqrt() * grad
                else:
                    variance = state["variance"]
                    variance.mul_(beta2).add_(square, alpha=1.0 - beta2)
                    update = variance.rsqrt() * grad
                rms = update.norm(2) / update.numel() ** 0.5
                update.div_((rms / group["d"]).clamp_(min=1.0)).mul_(lr)
                if wd != 0:
                    p.mul_(1.0 - wd * lr)
                p.sub_(update.to(p.dtype))
        return loss


def empty_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state of `p` before its first step (also what a checkpoint load fills in)."""
    step = torch.tensor(0.0)
    if p.dim() < 2:
        return {"step": step, "variance": torch.zeros_like(p, dtype=torch.float32)}
    rows, cols = list(p.shape), list(p.shape)
    rows[-1], cols[-2] = 1, 1
    return {"step": step, "row_var": p.new_zeros(rows, dtype=torch.float32),
            "col_var": p.new_zeros(cols, dtype=torch.float32)}
