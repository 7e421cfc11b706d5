"""Many tenants on one built rank: LoRA clients of one base model at one layout, each with its own training state,
stepped by the same `parallel.runtime.open_loop.OpenLoopRank` over one copy of the base.

Shared by every tenant (one copy on the rank): the built chunks and their frozen base weights, the process groups,
the gradient reducers and their buckets, the optimizer objects and their param groups (whose hyperparameters every
`optim_step` sets from its call anyway), the sampler and its tokenizer.
Per tenant: its adapters' values, the gradients it accumulated since its last `optim_step` (while it has some), its
optimizer state (per tensor the optimizer holds: AdamW's step and moments), its step count, and its sampler
snapshots.

One tenant is live at a time: its state is in the rank's own tensors (the adapter parameters, the buckets' gradient
views, the torch optimizers' `state` dicts), where the step, the reducers and the checkpoints find it as a lone
client's. `activate` parks the live tenant and brings another in: the adapters and pending gradients are copied out
and in (the parameters and bucket views keep their identity, so the reducers' hooks, ZeRO-1's views of the
parameters and the optimizer's references stay valid), the optimizer state dicts are moved by reference (no copy).
The copies are exact, so each tenant's calls give its run alone whatever other tenants' calls interleave. A parked
tenant holds its adapters and its optimizer state (and its gradients while it has some pending): the rank's memory
is the base once, one live tenant, and every other tenant's adapter state.

A new tenant starts as a new client does: adapters from PEFT's init drawn from its seed (`lora.init_adapter`, as
`parallel.runtime.materialize` fills them; a tensor-parallel adapter's part sliced as `lora.apply_lora` does), no
optimizer state (a torch optimizer's first step makes it), step 0.
Every rank of a client runs the same tenant calls in the same order (each rank swaps alone, no collective).

This module reads the reducers' buckets (`parallel.runtime.dp.data_parallel.GradientReducer`: the open loop's
layouts are zero 0 or 1, never FSDP2's) and the trainer's torch optimizers. No Ray here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from trainyard.parallel.models.components.lora import init_adapter, is_adapter
from trainyard.parallel.runtime.sampling.sampler import Sampler
from trainyard.parallel.runtime.tp.local_parts import local_part


class TenantError(KeyError):
    """A tenant this rank does not hold (or one it holds already, added again)."""


@dataclass
class Progress:
    """A tenant's place in its calls."""

    steps: int = 0
    """Its optimizer steps taken."""
    pending: bool = False
    """It accumulated gradients since its last `optim_step`."""


@dataclass
class Parked:
    """A tenant while another is live: its own copies of what the live one holds in the rank's tensors."""

    adapters: list[torch.Tensor]
    """Each trainable parameter's local part (`Tenants.params`' order)."""
    grads: list[torch.Tensor | None] | None
    """Each trainable parameter's accumulated gradient (None: none yet); None: nothing pending."""
    optim: list[dict]
    """Each optimizer-held tensor's state dict (`Tenants.held`' order); empty: no step taken yet."""
    progress: Progress
    snapshots: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Its sampler weights by name (`parallel.runtime.sampling.snapshots.Snapshots.saved`)."""


class Tenants:
    """The tenants of one rank (module doc): which one is live, and the others parked."""

    def __init__(self, trainer: Any, sampler: Sampler, first: str):
        """`trainer`: the rank's `parallel.runtime.trainer.RankTrainer` (its chunks, reducers and optimizer; not
        imported: a room never imports the runtime's top)."""
        self.trainer, self.sampler = trainer, sampler
        self.params = [(name, p) for chunk in trainer.chunks for name, p in chunk.named_parameters()
                       if p.requires_grad]
        self.held = [(o, t) for o in trainer.optimizer.optimizers for g in o.param_groups for t in g["params"]]
        """Each tensor a torch optimizer holds, with it: whose `state` entry is a tenant's."""
        self.views = {id(p): (b, i) for r in trainer.reducers.values() for b in getattr(r, "buckets", ())
                      for i, p in enumerate(b.params)}
        """Each parameter's bucket and index in it: where its accumulated gradient lives."""
        self.live: str | None = first
        self.now = Progress()
        """The live tenant's progress."""
        self.parked: dict[str, Parked] = {}

    @property
    def names(self) -> list[str]:
        return ([self.live] if self.live is not None else []) + list(self.parked)

    def activate(self, name: str | None) -> None:
        """Tenant `name` live (None: whichever is): the live one parked first. TenantError for one not held."""
        if name is None or name == self.live:
            if self.live is None:
                raise TenantError("no tenant is live on this rank")
            return
        if name not in self.parked:
            raise TenantError(f"no tenant {name!r} on this rank")
        self._park()
        self._unpark(name, self.parked.pop(name))

    def add(self, name: str, seed: int) -> None:
        """A new tenant `name`, live: fresh adapters from `seed`, no optimizer state, step 0 (module doc)."""
        if name in self.names:
            raise TenantError(f"tenant {name!r} is on this rank already")
        if not self.params or not all(is_adapter(n) for n, _ in self.params):
            raise ValueError("lora_config.rank: only LoRA clients share a base (a full fine-tune trains all of it)")
        self._park()
        with torch.no_grad():
            for n, p in self.params:
                local_part(p).copy_(_local_value(p, init_adapter(seed, n, (p.shape[0], p.shape[1]))))
        for o, t in self.held:
            o.state.pop(t, None)
        self.trainer.optimizer.params_changed()
        self.live, self.now = name, Progress()

    def drop(self, name: str) -> None:
        """Forget tenant `name`'s state (the live one's: no tenant is live until the next `activate` or `add`)."""
        if name == self.live:  # its state out of the rank's tensors: the next tenant in finds none of it
            for o, t in self.held:
                o.state.pop(t, None)
            self.live, self.now = None, Progress()
            self.sampler.snapshots.saved = {}
        elif self.parked.pop(name, None) is None:
            raise TenantError(f"no tenant {name!r} on this rank")

    def parked_bytes(self) -> int:
        """Bytes the parked tenants hold (their adapters, optimizer state, pending gradients and snapshots)."""
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()
        total = 0
        for parked in self.parked.values():
            total += sum(nbytes(a) for a in parked.adapters)
            total += sum(nbytes(g) for g in parked.grads or () if g is not None)
            total += sum(nbytes(v) for s in parked.optim for v in s.values() if isinstance(v, torch.Tensor))
            total += sum(nbytes(t) for ts in parked.snapshots.values() for t in ts)
        return total

    @torch.no_grad()
    def _park(self) -> None:
        """The live tenant's state moved out of the rank's tensors (nothing when no tenant is live)."""
        if self.live is None:
            return
        self.trainer.optimizer.settle()
        grads = [None if p.grad is None else local_part(p.grad).detach().clone() for _, p in self.params] \
            if self.now.pending else None
        self.parked[self.live] = Parked(
            adapters=[local_part(p).detach().clone() for _, p in self.params], grads=grads,
            optim=[o.state.pop(t, {}) for o, t in self.held], progress=self.now,
            snapshots=self.sampler.snapshots.saved)
        self.sampler.snapshots.saved = {}
        self.live = None

    @torch.no_grad()
    def _unpark(self, name: str, parked: Parked) -> None:
        for (_, p), value in zip(self.params, parked.adapters, strict=True):
            local_part(p).copy_(value)
        if parked.grads is not None:  # into the bucket views, as the reducer's hook leaves them (`_accumulated`)
            for (_, p), grad in zip(self.params, parked.grads, strict=True):
                bucket, i = self.views[id(p)]
                if grad is None:
                    p.grad = None
                else:
                    local_part(bucket.grads[i]).copy_(grad)
                    p.grad = bucket.grads[i]
            for bucket in {id(b): b for b, _ in self.views.values()}.values():
                bucket.landed = sum(p.grad is not None for p in bucket.params)
        for (o, t), state in zip(self.held, parked.optim, strict=True):
            if state:
                o.state[t] = state
            else:  # no step taken yet: a first step makes its state, as a new client's
                o.state.pop(t, None)
        self.trainer.optimizer.params_changed()  # offloaded: the host copies the optimizer steps
        self.sampler.snapshots.saved = parked.snapshots
        self.live, self.now = name, parked.progress


def _local_value(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of `whole`, the value of parameter `p` (a DTensor's: its placements' slice)."""
    if isinstance(p, DTensor):
        return distribute_tensor(whole.to(p.to_local().device), p.device_mesh, p.placements,
                                 src_data_rank=None).to_local()
    return whole
