"""Each optimizer kind's own state for one tensor, converted to and from the checkpoint's form: fp32 tensors
in the tensor's shape under the registry's names (`parallel.optim.kinds`), so that a checkpoint reshards like
AdamW's whatever the optimizer, and its bytes as measured.

- adamw: the state is the checkpoint's form already.
- adamw8bit: torchao's `OptimState8bit` moments are saved dequantized to fp32 under AdamW's names
  (exp_avg, exp_avg_sq) and quantized again on load. Chosen over saving the codes and scales: DCP reshards
  a tensor in the parameter's shape, and block scales belong to the blocks of one layout's local pieces
  (a tp shard, a ZeRO-1 slice), which another layout cuts elsewhere. The round trip costs one
  re-quantization (within a block's quantization step) at each resume, and the checkpoint is as large as
  AdamW's.
- adamw4bit: the same for torchao's `OptimState4bit` (4-bit codes, 128-element blocks): a round trip costs one
  re-quantization within a block's 4-bit step.
- adafactor: the factored second moment of a matrix piece (row_var, col_var) is saved as the estimate Adafactor
  itself uses, v = row_var col_var / mean(row_var), in the piece's shape, under `exp_avg_sq`; on load each piece
  factors its part of v again by row and column means. For a piece of the same rows and columns that gives back
  row_var and col_var (v's row means are row_var, its column means col_var: exact in arithmetic, to fp32 rounding
  in the computer, 8e-8 relative after a resume in bench.gpu_smoke); a piece of other rows (another tp degree,
  another ZeRO-1 cut) gets the factors of its part of the same rank-1 estimate, whose product is that part
  exactly. The factoring is per local piece, not over the whole parameter: Adafactor's statistics (row and column
  means, the update's RMS for clipping) are those of what this rank holds (`parallel.optim.adafactor` steps local
  tensors), so layouts that cut a matrix differently train slightly different (equally valid) Adafactors. Making
  them global would need a collective per statistic per tensor inside the step.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from trainyard.parallel.optim import adafactor
from trainyard.parallel.optim.kinds import ADAFACTOR, OptimizerKind


def empty_state(kind: OptimizerKind, optimizer: torch.optim.Optimizer, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state `optimizer` would create for `t` at its first step (a checkpoint before it, or a load,
    needs the state to exist)."""
    step = torch.tensor(0.0)
    if kind.quantized:
        from torchao.optim.adam import _AdamBase  # imported already: the registry built this optimizer from it

        assert isinstance(optimizer, _AdamBase)
        return {"step": step, "exp_avg": optimizer._new_buffer(t, True), "exp_avg_sq": optimizer._new_buffer(t, False)}
    if kind is ADAFACTOR:
        return adafactor.empty_state(t)
    return {"step": step, **{k: torch.zeros_like(t, memory_format=torch.preserve_format) for k in kind.state}}


@torch.no_grad()
def export(kind: OptimizerKind, optimizer: torch.optim.Optimizer, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """`t`'s state in the checkpoint's form: plain fp32 tensors shaped like t's local part (new tensors,
    except for AdamW, whose state is returned itself)."""
    state = optimizer.state[t]
    if kind is ADAFACTOR:
        if "variance" in state:
            return {"exp_avg_sq": state["variance"].clone()}
        eps1 = _group_of(optimizer, t)["eps"][0] or torch.finfo(t.dtype).eps
        rows, cols = state["row_var"], state["col_var"]
        return {"exp_avg_sq": (rows @ cols).div_(rows.mean(dim=-2, keepdim=True).clamp(min=eps1))}
    if kind.identity_state:
        return {k: _local(state[k]) for k in kind.state}
    return {k: _dequantized(_local(state[k])) for k in kind.state}


@torch.no_grad()
def load(kind: OptimizerKind, optimizer: torch.optim.Optimizer, t: torch.Tensor,
         values: dict[str, torch.Tensor]) -> None:
    """Set `t`'s state from the checkpoint's form (`export`'s), quantizing or factoring it again."""
    state = optimizer.state[t]
    if kind is ADAFACTOR:
        v = values["exp_avg_sq"]
        if "variance" in state:
            state["variance"].copy_(v)
        else:
            state["row_var"].copy_(v.mean(dim=-1, keepdim=True))
            state["col_var"].copy_(v.mean(dim=-2, keepdim=True))
        return
    for k in kind.state:
        mine = _local(state[k])
        if mine is not values[k]:
            mine.copy_(values[k])  # an OptimState8bit or OptimState4bit quantizes what it is given


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really holds: a DTensor its local part, a tensor subclass (torchao's 8- or 4-bit state)
    the tensors inside it (codes, scales, its map)."""
    t = _local(t)
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size() if t.dim() > 0 else 0


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    # torchao's OptimState8bit/4bit.dequantize take the output dtype; torch's stub knows only quantized tensors' form
    return t.dequantize(torch.float32) if hasattr(t, "codes") else t.detach().clone().float()  # type: ignore[call-arg]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _group_of(optimizer: torch.optim.Optimizer, t: torch.Tensor) -> dict:
    return next(g for g in optimizer.param_groups if any(p is t for p in g["params"]))
