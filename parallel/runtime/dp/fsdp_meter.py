"""What FSDP2 holds gathered on a rank (ZeRO-2/3, `parallel.runtime.dp.fsdp`), measured while the step runs.

`GatheredMeter.gathered` is the set of addresses of the storages that hold gathered (whole) parameters right now:
the pipeline's saved-tensor meter skips them (they are parameters, not activations). `peak_gathered_bytes` is the
most bytes of gathered parameters, whole or in flight, held at once since `reset`: what the memory plan's
`gathered` figure (per block at ZeRO-3: two units) is checked against.

FSDP2 has no such meter, so this one reads its private per-unit state (torch 2.13: each parameter group's
`fsdp_params`, whose `all_gather_outputs` hold the gathered parameter, and `_all_gather_result`, a gather in
flight). It looks after FSDP2's own hooks: before and after each unit's forward (hooks registered after FSDP2's:
its pre-forward gathers, its post-forward frees) and when the unit's backward starts (a hook on the unit's
outputs, registered after FSDP2's pre-backward one, so it runs once FSDP2 has gathered the unit and started the
gather of the next). A look refreshes only the unit's neighbourhood (the units next to it in its chunk's order:
the one just freed, the one being gathered, and the routers and experts inside them) and the unit the next action
starts with (`target`), so its cost does not grow with the number of blocks; `look_all` (once per action, from
the pipeline executor's `before_compute`) catches what no hook saw, such as a backward's last unit being freed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils._pytree import tree_leaves


class GatheredMeter:
    def __init__(self, wrapped: list[FSDPModule], near: dict[FSDPModule, list[FSDPModule]],
                 members: dict[FSDPModule, list[nn.Module]]):
        """`wrapped`: every FSDP2 module of the rank; `near`: each unit -> the units whose state may change while it
        runs; `members`: each unit -> the modules it was made of (its hooks go on each)."""
        self.wrapped, self.near = wrapped, near
        self.peak_gathered_bytes = 0
        """Most bytes of gathered parameters (whole, or in flight) held at once since `reset`."""
        self.gathered: set[int] = set()
        """Addresses of the storages holding gathered (whole) parameters: what the saved-tensor meter skips."""
        self.target: FSDPModule | None = None
        """The unit the next compute action runs first (being gathered by the end of this one)."""
        self._storages: dict[FSDPModule, dict[int, int]] = {}
        self._held = 0
        for unit, modules in members.items():
            for module in modules:
                module.register_forward_pre_hook(self._before_hook(unit))
                module.register_forward_hook(self._after_hook(unit))

    def reset(self) -> None:
        self.peak_gathered_bytes = 0

    def look_all(self) -> None:
        for module in self.wrapped:
            self.refresh(module)
        self._sample(self.wrapped)

    def _before_hook(self, unit: FSDPModule) -> Callable[..., None]:
        @torch.compiler.disable
        def before(*_: object) -> None:
            self._look(unit)

        return before

    def _after_hook(self, unit: FSDPModule) -> Callable[..., None]:
        def at_backward(_: torch.Tensor) -> None:  # after FSDP2's pre-backward, registered on the same outputs
            self._look(unit)

        @torch.compiler.disable
        def after(_module: nn.Module, _args: object, output: object) -> None:
            self._look(unit)
            if torch.is_grad_enabled():
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(at_backward)

        return after

    def _look(self, unit: FSDPModule) -> None:
        near = self.near[unit] if self.target is None else list(dict.fromkeys([*self.near[unit], self.target]))
        for module in near:
            self.refresh(module)
        self._sample(near)

    def refresh(self, module: FSDPModule) -> None:
        """Look again at which storages of `module`'s parameters are gathered (allocated) now."""
        old = self._storages.get(module, {})
        new = {}
        for group in _param_groups(module):
            for p in group.fsdp_params:
                for t in p.all_gather_outputs:
                    if (n := t.untyped_storage().nbytes()) > 0:
                        new[t.untyped_storage().data_ptr()] = n
        self.gathered.difference_update(old)
        self.gathered.update(new)
        self._held += sum(new.values()) - sum(old.values())
        self._storages[module] = new

    def _sample(self, modules: list[FSDPModule]) -> None:
        """The peak so far, with the buffers of gathers in flight on `modules`."""
        in_flight = sum(group._all_gather_result.all_gather_output.untyped_storage().nbytes()
                        for module in modules for group in _param_groups(module)
                        if group._all_gather_result is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._held + in_flight)


def _param_groups(module: FSDPModule) -> list:
    # Private FSDP2 state (torch 2.13): a wrapped module's parameter groups, each with its `fsdp_params`
    # (whose `all_gather_outputs` hold the gathered parameter) and the all-gather in flight.
    return fully_shard.state(module)._fsdp_param_groups  # type: ignore[attr-defined]  # set on the function by torch
