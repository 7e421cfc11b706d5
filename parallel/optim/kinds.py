"""The optimizer registry: each optimizer's per-parameter state and its bytes, and how to build it.

`optimizer.kind` in the spec picks an entry. The memory plan asks it how many bytes of state a rank's
parameters cost (`parallel.plan.memory.estimate`), the checkpoint which tensors it keeps per parameter (saved under the
parameter's name in the parameter's shape, fp32, in every layout: see `parallel.optim.states`), and
`parallel.runtime.train_optimizer` builds it.

- `adamw`: torch's AdamW (foreach; fused when offloaded to the host): exp_avg and exp_avg_sq, fp32, 8 B per element.
- `adamw8bit`: torchao's `AdamW8bit` (Dettmers et al. 2021): both moments block-wise quantized to 8 bits
  (256-element blocks, an fp32 absmax scale per block, torchao's dynamic map), 2 B + 8/256 B per element;
  torchao keeps tensors under 4096 elements (or not a multiple of 256: biases, norms, the odd ZeRO-1 slice)
  in fp32, which the plan does not count (a fraction of a percent of a real model's state). Its step is
  `torch.compile`d on CUDA as torchao intends and run eagerly on CPU (inductor's CPU compile costs tens
  of seconds per tensor shape and the step is memory bound anyway).
- `adamw4bit`: torchao's `AdamW4bit` (Li et al. 2023): both moments block-wise quantized to 4 bits (128-element
  blocks, two codes a byte, an fp32 absmax scale per block; the first moment on a signed dynamic map, the second
  on a linear one without zero), 2 x (1/2 + 4/128) B per element; the same fp32 fallback for small tensors
  (under 4096 elements or not a multiple of 128) and the same eager step on CPU as adamw8bit.
- `adafactor`: Adafactor (Shazeer & Stern 2018) as HF transformers runs it with `relative_step=False`
  (`parallel.optim.adafactor`: no first moment, update clipping d = 1, `lr` under the job's schedule times each
  tensor's RMS (at least 1e-3: HF's default `scale_parameter`), decoupled weight decay): the second moment
  of a matrix factored into row and column means, O(rows + cols) fp32 per matrix (a vector keeps its full
  variance). The factoring is per local piece (a tensor-parallel
  shard, a ZeRO-1 slice cut into whole rows): see `parallel.optim.states`.
- `sgd`: torch's SGD (foreach) with heavy-ball momentum `beta1` (0: plain SGD): one momentum buffer, fp32, 4 B
  per element (at momentum 0 a buffer of zeros, made with the optimizer and never read, so that the state, its
  bytes and every checkpoint have the same tensors at any momentum). Weight decay enters the gradient (torch's
  SGD), which without momentum is the same as decoupled decay. Its update is linear in the gradient: with it
  and no clipping, averaging the replicas' parameters after a step (`parallel.sync` at every=1) is averaging
  their gradients before it, the exact check of local SGD.

Pure at import (the plan and the API read this without torch); the callables import torch when they run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainyard.parallel.config import OptimizerConfig
from trainyard.parallel.names import OPTIMIZER_NAMES, registry

if TYPE_CHECKING:
    import torch

FP32 = 4
BLOCK_8BIT = 256
"""torchao's block size for 8-bit states: one fp32 scale per this many elements."""
BLOCK_4BIT = 128
"""torchao's block size for 4-bit states (its AdamW4bit's default)."""


def _build_adamw(groups: list[dict], cfg: OptimizerConfig, host: bool = False) -> torch.optim.Optimizer:
    """foreach on the device; on the host (offload) torch's fused CPU kernel, which ran several times foreach's
    speed there when a GPU machine's 16 cores stepped a 406M model (not a committed row: to be measured again)."""
    # here, not at the top: the plan and the API read the registry without loading torch
    from trainyard.parallel.optim.dynamo_free import AdamW

    kernel = {"fused": True} if host else {"foreach": True}
    return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kernel)


def _build_adamw8bit(groups: list[dict], cfg: OptimizerConfig, host: bool = False) -> torch.optim.Optimizer:
    from trainyard.parallel.optim.low_bit import adamw8bit

    return adamw8bit(groups, cfg)


def _build_adamw4bit(groups: list[dict], cfg: OptimizerConfig, host: bool = False) -> torch.optim.Optimizer:
    from trainyard.parallel.optim.low_bit import adamw4bit

    return adamw4bit(groups, cfg)


def _build_adafactor(groups: list[dict], cfg: OptimizerConfig, host: bool = False) -> torch.optim.Optimizer:
    from trainyard.parallel.optim.adafactor import Adafactor

    return Adafactor(groups, lr=cfg.lr, scale_parameter=True)


def _build_sgd(groups: list[dict], cfg: OptimizerConfig, host: bool = False) -> torch.optim.Optimizer:
    import torch
    from trainyard.parallel.optim.dynamo_free import SGD

    optimizer = SGD(groups, lr=cfg.lr, momentum=cfg.beta1, foreach=True)
    if cfg.beta1 == 0:  # torch's SGD then neither reads nor writes a buffer: zeros from the start, as the plan counts
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    state: tuple[str, ...]
    """The tensors the checkpoint keeps per parameter, each fp32 in the parameter's shape (the optimizer's
    own state is converted to and from them: `parallel.optim.states`)."""
    build: Callable[..., torch.optim.Optimizer]
    """`build(groups, cfg, host=False)`: builds it over parameter groups (`{"params": [...], "weight_decay": ...}`)
    with the spec's settings; `host`: the parameters are offloaded host copies (AdamW then takes torch's fused
    CPU kernel). Every kind takes `host`, whether or not it builds differently there."""
    plan_bytes: Callable[[int, int], int]
    """(parameter elements, d_model) -> bytes of state the memory plan counts for them."""
    matrices: bool = False
    """It wants each piece of a matrix as whole rows (2-D views), as factored states do."""
    identity_state: bool = False
    """Its own state tensors are the checkpoint's (fp32, the tensor's shape): saved and loaded in place."""
    quantized: bool = False
    """Its moments are torchao's quantized tensors (`OptimState8bit`, `OptimState4bit`): the checkpoint holds them
    dequantized, and a load quantizes them again (`parallel.optim.states`)."""
    adam_betas: bool = False
    """It reads beta1 and beta2 as Adam's moment decays, which must be below 1 (its bias correction divides by
    1 - beta**step; torch and torchao refuse 1): `parallel.plan.rules` refuses 1 at submit."""

    def state_bytes(self, elements: int, d_model: int = 1) -> int:
        """Bytes of state for `elements` parameter elements of a model of width `d_model`."""
        return self.plan_bytes(elements, d_model)


def _adafactor_bytes(elements: int, d_model: int) -> int:
    """Every matrix of a block has d_model (or a tp shard of a multiple of it) on one side: rows + cols of a
    (d, k d) matrix is (1 + 1/k) n / d <= 2 n / d. An estimate (the vectors' full variances are left out)."""
    return FP32 * math.ceil(2 * elements / max(1, d_model))


ADAMW = OptimizerKind(name="adamw", state=("exp_avg", "exp_avg_sq"), build=_build_adamw,
                      plan_bytes=lambda n, d: 2 * FP32 * n, identity_state=True, adam_betas=True)
ADAMW8BIT = OptimizerKind(name="adamw8bit", state=("exp_avg", "exp_avg_sq"), build=_build_adamw8bit,
                          plan_bytes=lambda n, d: 2 * (n + FP32 * math.ceil(n / BLOCK_8BIT)), quantized=True,
                          adam_betas=True)
ADAMW4BIT = OptimizerKind(name="adamw4bit", state=("exp_avg", "exp_avg_sq"), build=_build_adamw4bit,
                          plan_bytes=lambda n, d: 2 * (math.ceil(n / 2) + FP32 * math.ceil(n / BLOCK_4BIT)),
                          quantized=True, adam_betas=True)
ADAFACTOR = OptimizerKind(name="adafactor", state=("exp_avg_sq",), build=_build_adafactor,
                          plan_bytes=_adafactor_bytes, matrices=True)
SGD = OptimizerKind(name="sgd", state=("momentum_buffer",), build=_build_sgd, plan_bytes=lambda n, d: FP32 * n,
                    identity_state=True)

OPTIMIZERS: dict[str, OptimizerKind] = registry(
    OPTIMIZER_NAMES, {k.name: k for k in (ADAMW, ADAMW8BIT, ADAMW4BIT, ADAFACTOR, SGD)},
    "parallel.optim.kinds.OPTIMIZERS")
"""`optimizer.kind` -> its optimizer (the names: `parallel.names.OptimizerName`)."""


def optimizer_kind(cfg: OptimizerConfig) -> OptimizerKind:
    try:
        return OPTIMIZERS[cfg.kind]
    except KeyError:
        raise ValueError(f"no optimizer {cfg.kind!r}; known: {sorted(OPTIMIZERS)}") from None
