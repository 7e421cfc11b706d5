"""Experts as one grouped matmul: every expert's rows through its own weight in one `torch._grouped_mm` call.

An MoE layer's rows come sorted by expert (`parallel.models.components.moe`); `offs` holds where each expert's rows end
(int32, on the device, cumulative). `grouped_linear(rows, weights, offs, biases)` is, for each expert e,
`rows[offs[e-1]:offs[e]] @ weights[e].T + biases[e]` (`nn.Linear`'s), in one call where the loop over the experts
issues one matmul (and its launch) per expert. The families' expert modules (gpt2's `MLP`, llama's `SwiGLU`) have a
`grouped(experts, rows, offs)` that runs them so.

Where: `torch._grouped_mm` has a fast kernel on CUDA devices of compute capability 9.0 and above (Hopper) in bf16,
and needs 16-byte aligned rows (widths a multiple of 8). `use_grouped_mm` says whether a call qualifies; elsewhere
the layer loops over its experts as before. torch also runs `_grouped_mm` on CPU (a fallback, in fp32 too), which is
how tests/unit/test_moe.py checks the grouped path's numbers against the loop's here.

Autocast does not cover `_grouped_mm`: the rows and weights are cast to the autocast dtype here, as autocast casts
`nn.Linear`'s, and the product comes out in it.
"""

from __future__ import annotations

import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `t` runs in: autocast's on its device when enabled, else `t`'s."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def use_grouped_mm(rows: torch.Tensor, hidden: int) -> bool:
    """Whether the grouped kernel serves this call: a Hopper-or-later CUDA device, bf16, aligned widths."""
    if not (hasattr(torch, "_grouped_mm") and rows.is_cuda and compute_dtype(rows) == torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(rows.device) >= (9, 0) and rows.shape[-1] % 8 == 0 and hidden % 8 == 0


def grouped_linear(rows: torch.Tensor, weights: list[torch.Tensor], offs: torch.Tensor,
                   biases: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Each expert's rows (`offs`: where they end) times its `nn.Linear` weight (out, in), plus its bias."""
    dtype = compute_dtype(rows)
    # (experts, in, out) as a transposed view of the stacked (out, in) weights: the layout the kernel takes
    stacked = torch.stack([w.to(dtype) for w in weights]).transpose(1, 2)
    out = torch._grouped_mm(rows.to(dtype), stacked, offs=offs)
    if biases is not None:
        expert_of_row = torch.searchsorted(offs, torch.arange(rows.shape[0], device=rows.device, dtype=offs.dtype),
                                           right=True)
        out = out + torch.stack([b.to(dtype) for b in biases])[expert_of_row]
    return out
