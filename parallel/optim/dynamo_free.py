"""torch's optimizers without the import of torch._dynamo that their first calls make, where nothing compiles.

torch.optim runs `Optimizer.add_param_group` (so every optimizer's construction) under `torch._disable_dynamo`,
and Adam's, AdamW's and SGD's `step` under a grad-mode wrapper that calls `torch._dynamo.graph_break()`; each
imports torch._dynamo on its first call. That import is about 1.1 s of CPU in every rank process (of about 6 s to
start one), though only `compile: true`, torchao's adamw8bit and adamw4bit (which compile their step), tensor
parallelism (DTensor) and ZeRO-2/3 (FSDP2) use dynamo.

Outside a compiled region the two wrappers only call the function: `disable` sets dynamo's frame callback to none
for the call, which it already is, and `graph_break` does nothing. Nothing is compiled before torch._dynamo is
imported. So while it is not imported, `DynamoFree` calls the wrapped functions themselves (`step` in the grad
mode the wrapper sets, `differentiable`, False for ours); once it is, torch's wrappers run, as they would without
this class. The arithmetic is torch's own code either way, so the numbers are the same bits
(tests/unit/test_dynamo_free.py). Where torch's wrappers are not the ones described here (another torch version),
torch's path runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import MethodType

import torch


def _under(fn: object, wrapper: str) -> Callable | None:
    """The function that torch's wrapper `wrapper` (the qualified name of its code) wraps in `fn`, else None."""
    code = getattr(fn, "__code__", None)
    inner = getattr(fn, "__wrapped__", None)
    return inner if code is not None and code.co_qualname == wrapper else None


_TORCHS_ADD_PARAM_GROUP = torch.optim.Optimizer.add_param_group
_ADD_PARAM_GROUP = _under(_TORCHS_ADD_PARAM_GROUP, "_disable_dynamo.<locals>.inner")


def _raw_step(cls: type) -> Callable | None:
    """The step of the first class after DynamoFree in `cls`'s MRO that defines one, under torch's grad-mode wrapper
    (and the profiling wrapper torch puts on a class's step once it has an instance); None if it has no such wrapper."""
    mro = cls.__mro__
    for base in mro[mro.index(DynamoFree) + 1:]:
        if "step" in vars(base):
            step = vars(base)["step"]
            step = _under(step, "Optimizer.profile_hook_step.<locals>.wrapper") or step
            return _under(step, "_use_grad_for_differentiable.<locals>._use_grad")
    return None


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


class DynamoFree(torch.optim.Optimizer):
    """Put first among an optimizer's bases (`class AdamW(DynamoFree, torch.optim.AdamW)`)."""

    def add_param_group(self, param_group: dict) -> None:
        inherited = super().add_param_group
        torchs = isinstance(inherited, MethodType) and inherited.__func__ is _TORCHS_ADD_PARAM_GROUP
        if _ADD_PARAM_GROUP is None or _dynamo_loaded() or not torchs:
            return inherited(param_group)
        return _ADD_PARAM_GROUP(self, param_group)

    def step(self, closure=None):
        raw = _raw_step(type(self))
        if raw is None or _dynamo_loaded():
            return super().step(closure)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return raw(self, closure)


class AdamW(DynamoFree, torch.optim.AdamW):
    pass


class SGD(DynamoFree, torch.optim.SGD):
    pass
