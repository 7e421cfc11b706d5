"""The rank's optimizer as the trainer uses it: the spec's kind (`parallel.optim.kinds`) over what the
reducers hand it, optionally offloaded to the host (ZeRO-Offload), with its state exported to and taken
from the checkpoint's form.

What it updates: the reducers give (tensor, parameter) pairs, the parameters or, with ZeRO-1, views of
this rank's slices of them (`GradientReducer.optimizer_params`). Each becomes one or more *leaves*, the
tensors the torch optimizer holds: the tensor itself, or for a factored kind (adafactor) its whole rows
as a 2-D view plus the partial rows at either end as 1-D views (a ZeRO-1 slice starts and ends anywhere
in a matrix), each with the matching view of the gradient as `.grad`, so the update lands in the
parameter. The reducers read and fill the optimizer's state through `export()`, a `StateView` whose
`.state[tensor][name]` has the shape of the reducers' tensor (`parallel.optim.states` converts).

Offload (`optimizer.offload: true`): each leaf has a host copy (pinned when CUDA is available) with a host
gradient, and the torch optimizer, so all of its state, lives on the host and steps there. A step copies
the (reduced, clipped) gradients to the host on a side stream, then steps the leaves in chunks of
STEP_CHUNK elements: while the CPU steps chunk i+1, chunk i's updated values go back to the device on
the side stream. The default stream waits for those copies before the next kernel that could read the
parameters (the ZeRO-1 all-gather, the next step's forward), without blocking the host: the host is free
to read the next step's batch and queue its forward while the last copies land. The update is not
delayed by a step (DeepSpeed's delayed parameter update would overlap the whole CPU step with the next
forward, at the price of a stale update): losses equal the non-offloaded ones.

Overlapped (`optimizer.offload_overlap`, with the model's forward `units` given): the chunks follow the forward's
units (the embedding, each block, the head; a unit larger than STEP_CHUNK is cut further), and the chunk
steps run on a background thread (`parallel.runtime.host_steps`) after `step` returns: the next step's forward
waits, unit by unit, for the chunks of the unit it is about to run, so the host steps the later units while
the device runs the first ones, as ZeRO-Offload does. Every update still lands before anything reads it (the
losses are bitwise those of the same offload run without overlap); whatever reads parameters or state outside
the forward calls `settle` first.

torchao's `CPUOffloadOptimizer` is not used: it refuses CPU-only machines, and it copies each parameter's
gradient to the host from a post-accumulate hook, before the data-parallel reduction and the clipping that
the trainer does afterwards, and on parameters only (not ZeRO-1 slices).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from trainyard.parallel.config import OptimizerConfig
from trainyard.parallel.optim import states as optimizer_states
from trainyard.parallel.optim.kinds import OptimizerKind, optimizer_kind
from trainyard.parallel.runtime.host_steps import HostSteps
from trainyard.parallel.runtime.tp.local_parts import like_param as _like
from trainyard.parallel.runtime.tp.local_parts import local_part as _local

STEP_CHUNK = 2**24
"""Elements per torch optimizer (64 MiB of fp32): the bound on a step's temporaries, and offloaded, the grain of the
H2D copies' overlap."""


@dataclass
class Leaf:
    owner: torch.Tensor
    """The reducers' tensor it is part of."""
    start: int
    """Where it starts in the owner's local part, flattened."""
    tensor: torch.Tensor
    """What is updated: the owner, or a view of the owner's local part."""
    held: torch.Tensor
    """What the torch optimizer holds: `tensor`, or its host copy when offloaded."""

    @property
    def numel(self) -> int:
        return _local(self.tensor).numel()


class StateView:
    """The optimizer's state in the checkpoint's form, `state[tensor][name]` (a DTensor for a DTensor),
    for the reducers to read (`moments`) and fill (`load_moments`); `write_back` after they filled it."""

    def __init__(self, state: dict[torch.Tensor, dict[str, torch.Tensor]], owner: TrainOptimizer, copied: bool):
        self.state, self._owner, self._copied = state, owner, copied

    def write_back(self) -> None:
        if self._copied:
            self._owner.load_view(self)


class TrainOptimizer:
    def __init__(self, params: Iterable[tuple[torch.Tensor, nn.Parameter]], cfg: OptimizerConfig,
                 offload: bool = False, units: Sequence[Sequence[nn.Parameter]] | None = None,
                 overlap: bool = False):
        """`units`: offloaded, the model's parameters by forward unit, in forward order: the chunks follow them.
        `overlap` (needs `units`): the chunk steps run behind the next forward (module doc); the caller makes
        each unit's forward call `ready(unit)` (`host_steps.wait_in_forward`)."""
        self.kind: OptimizerKind = optimizer_kind(cfg)
        self.offload = offload
        self.overlap = offload and overlap and units is not None
        pairs = list(params)
        self.leaves: dict[torch.Tensor, list[Leaf]] = {t: _leaves(t, p, self.kind.matrices) for t, p in pairs}
        self.cuda = any(_local(t).is_cuda for t, _ in pairs)
        if offload:
            for leaf in self._all_leaves():
                leaf.held = _host_copy(_local(leaf.tensor), pin=self.cuda)
        decays = {id(leaf.held): p.dim() >= 2 for t, p in pairs for leaf in self.leaves[t]}
        # Groups as `parallel.optim.optimizer.make_optimizer` forms them, one optimizer per chunk of STEP_CHUNK
        # elements of each, or offloaded with `units` per chunk of each unit (its groups inside): a foreach step
        # makes temporaries as large as all the tensors it steps (AdamW: the square root of the second moments, the
        # scaled gradients), which over a rank's whole state were one more copy of its parameters at the step's
        # peak. Elementwise, the chunks' updates are the same bits.
        chunks: list[list[Leaf]] = []
        self._unit_chunks: list[list[int]] = []
        if offload and units is not None:
            for unit in _by_unit(pairs, self.leaves, units):
                self._unit_chunks.append(list(range(len(chunks), len(chunks) + len(unit))))
                chunks += unit
        else:
            by_decay: dict[bool, list[Leaf]] = {True: [], False: []}
            for t, p in pairs:
                by_decay[p.dim() >= 2] += self.leaves[t]
            chunks = [c for leaves in by_decay.values() for c in _chunks(leaves, STEP_CHUNK)]
        self.optimizers: list[torch.optim.Optimizer] = []
        for chunk in chunks:
            groups = [{"params": [leaf.held for leaf in chunk if isinstance(leaf.held, DTensor) == sharded
                                  and decays[id(leaf.held)] == decay],
                       "weight_decay": cfg.weight_decay if decay else 0.0}
                      for decay in (True, False) for sharded in (False, True)]
            groups = [g for g in groups if g["params"]]
            if groups:
                self.optimizers.append(self.kind.build(groups, cfg, host=offload))
        self._optimizer_of = {id(t): o for o in self.optimizers for g in o.param_groups for t in g["params"]}
        self._stream = torch.cuda.Stream() if offload and self.cuda else None
        leaf_of_held = {id(leaf.held): leaf for leaf in self._all_leaves()}
        self._offload_chunks = [[leaf_of_held[id(held)] for g in o.param_groups for held in g["params"]]
                                for o in self.optimizers] if offload else []
        self._host = HostSteps()
        self._state_bytes: tuple[int, int] | None = None
        """`state_bytes` as last counted (the state's sizes do not change between steps); None: count again."""
        self._state_entries = 0
        """Not overlapped: the state's entries when `_state_bytes` was counted."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def _all_leaves(self) -> list[Leaf]:
        return [leaf for leaves in self.leaves.values() for leaf in leaves]

    def _link_grads(self) -> None:
        """Each view leaf's `.grad`: the same view of its owner's gradient (a bucket's view, kept for the job,
        or with ZeRO-2/3 the sharded gradient FSDP2 makes anew in every backward)."""
        for t, leaves in self.leaves.items():
            if t.grad is None or leaves[0].tensor is t:
                continue
            flat = _local(t.grad).reshape(-1)
            for leaf in leaves:
                leaf.tensor.grad = flat[leaf.start:leaf.start + leaf.numel].view(_local(leaf.tensor).shape)

    @torch.no_grad()
    def step(self) -> None:
        self.settle()
        self._link_grads()
        if not self.offload:
            for o in self.optimizers:
                o.step()
            return
        with _on(self._stream):
            for leaf in self._all_leaves():
                host_grad, grad = leaf.held.grad, leaf.tensor.grad
                # `_host_copy` made the host gradient; the reducers (or `_link_grads`, for a view) set the device one
                assert host_grad is not None and grad is not None
                host_grad.copy_(_local(grad).reshape(leaf.held.shape), non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()  # the gradients are on the host
        for i, (o, chunk) in enumerate(zip(self.optimizers, self._offload_chunks, strict=True)):
            if self.overlap:  # behind the next forward, which waits for it unit by unit (`ready`)
                self._host.submit(i, functools.partial(self._step_chunk, o, chunk))
            else:
                self._step_chunk(o, chunk)
        if self._stream is not None and not self.overlap:
            torch.cuda.current_stream().wait_stream(self._stream)

    def _step_chunk(self, o: torch.optim.Optimizer, chunk: list[Leaf]) -> None:
        o.step()
        with _on(self._stream):  # back to the device while the CPU steps the next chunk
            for leaf in chunk:
                _local(leaf.tensor).copy_(leaf.held.view_as(_local(leaf.tensor)), non_blocking=True)

    def ready(self, unit: int) -> None:
        """Overlapped: the parameters of forward unit `unit` updated by the last step (waits for its chunks)."""
        if not self._host.busy:
            return
        self._host.wait(self._unit_chunks[unit])
        if self._stream is not None:  # their copies to the device were queued on the side stream
            torch.cuda.current_stream().wait_stream(self._stream)

    def settle(self) -> None:
        """Overlapped: every chunk of the last step updated, on the host and on the device."""
        if not self._host.busy:
            return
        self._host.settle()
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def init_state(self) -> None:
        """The state each optimizer creates at its first step, created now (a checkpoint before it, or a
        load, needs the state to exist)."""
        self.settle()
        self._state_bytes = None
        for leaf in self._all_leaves():
            o = self._optimizer_of[id(leaf.held)]
            if not o.state[leaf.held]:
                o.state[leaf.held] = optimizer_states.empty_state(self.kind, o, leaf.held)

    def set_step(self, step: int) -> None:
        self.settle()
        for o in self.optimizers:
            for state in o.state.values():
                if "step" in state:  # SGD keeps no step counter
                    state["step"].fill_(step)

    @torch.no_grad()
    def export(self) -> StateView:
        """The state of every reducers' tensor in the checkpoint's form: AdamW's own tensors where they are
        that already (filled in place by a load), new tensors otherwise (`StateView.write_back` takes them)."""
        self.init_state()
        identity = self.kind.identity_state and not self.offload and not self.kind.matrices
        state = {}
        for t, leaves in self.leaves.items():
            if identity:
                o = self._optimizer_of[id(t)]
                state[t] = {k: o.state[t][k] for k in self.kind.state}
                continue
            local = _local(t)
            flat = {k: torch.zeros(local.numel(), dtype=torch.float32, device=local.device) for k in self.kind.state}
            for leaf in leaves:
                values = optimizer_states.export(self.kind, self._optimizer_of[id(leaf.held)], leaf.held)
                for k, v in values.items():
                    flat[k][leaf.start:leaf.start + leaf.numel].copy_(v.reshape(-1))
            state[t] = {k: _like(t, v.view(local.shape)) for k, v in flat.items()}
        return StateView(state, self, copied=not identity)

    @torch.no_grad()
    def params_changed(self) -> None:
        """The parameters were changed outside a step (local_sgd / diloco's sync): offloaded, into the host copies
        the optimizer steps, or its next step would undo the change."""
        self.settle()
        if self.offload:
            for leaf in self._all_leaves():
                leaf.held.copy_(_local(leaf.tensor).view(_local(leaf.held).shape))

    @torch.no_grad()
    def load_view(self, view: StateView) -> None:
        """Take every tensor's state from `view` (quantizing or factoring it again), and, offloaded, the
        parameters' current values into the host copies (a load or a resize changed them)."""
        self.settle()
        self._state_bytes = None
        for t, leaves in self.leaves.items():
            flat = {k: _local(v).reshape(-1) for k, v in view.state[t].items()}
            for leaf in leaves:
                shape = _local(leaf.held).shape
                values = {k: v[leaf.start:leaf.start + leaf.numel].view(shape) for k, v in flat.items()}
                optimizer_states.load(self.kind, self._optimizer_of[id(leaf.held)], leaf.held, values)
                if self.offload:
                    leaf.held.copy_(_local(leaf.tensor).view(shape))

    def state_bytes(self) -> tuple[int, int]:
        """(device, host) bytes of the optimizer's state; offloaded, the host also holds each leaf's copy and
        its gradient."""
        if self.overlap:  # counted once the state exists (the first step settled), not while a step runs on it
            if self._state_bytes is None:
                self.settle()
                self._state_bytes = self._count_state_bytes()
            return self._state_bytes
        # Counted again only when tensors were added to the state (its first step): a count over every state
        # tensor is some 200 Python calls a step for a small model.
        entries = sum(len(o.state) for o in self.optimizers)
        if self._state_bytes is None or entries != self._state_entries:
            self._state_bytes, self._state_entries = self._count_state_bytes(), entries
        return self._state_bytes

    def _count_state_bytes(self) -> tuple[int, int]:
        held = sum(optimizer_states.tensor_bytes(t) for o in self.optimizers for s in o.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor))
        if not self.offload:
            return held, 0
        copies = sum(2 * leaf.held.numel() * leaf.held.element_size() for leaf in self._all_leaves())
        return 0, held + copies


def _leaves(t: torch.Tensor, p: nn.Parameter, matrices: bool) -> list[Leaf]:
    """`t` itself; for a factored kind and a matrix parameter, its whole rows as a 2-D view and the partial
    rows at either end as 1-D views (t is the parameter, or a ZeRO-1 slice of its local part)."""
    if not matrices:
        return [Leaf(owner=t, start=0, tensor=t, held=t)]
    local = _local(t).detach()
    flat = local.reshape(-1)
    n = flat.numel()
    cuts = [0, n]
    if p.dim() >= 2:
        cols = int(_local(p).shape[-1])
        offset = int(local.storage_offset() - _local(p).storage_offset())  # where the slice starts in the parameter
        first, last = -offset % cols, n - (offset + n) % cols
        if first < last:
            cuts = sorted({0, first, last, n})
    leaves = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        view = flat[a:b]
        if p.dim() >= 2 and (b - a) % cols == 0 and (a + offset) % cols == 0:
            view = view.view(-1, cols)
        leaves.append(Leaf(owner=t, start=a, tensor=view, held=view))
    return leaves


def _by_unit(pairs: list[tuple[torch.Tensor, nn.Parameter]], leaves: dict[torch.Tensor, list[Leaf]],
             units: Sequence[Sequence[nn.Parameter]]) -> list[list[list[Leaf]]]:
    """Each unit's leaves cut into chunks (in forward order); a parameter in no unit goes with the first, whose
    forward comes first."""
    unit_of: dict[int, int] = {}
    for i, unit in enumerate(units):
        for p in unit:
            unit_of.setdefault(id(p), i)
    by_unit: list[list[Leaf]] = [[] for _ in units]
    for t, p in pairs:
        by_unit[unit_of.get(id(p), 0)] += leaves[t]
    return [_chunks(unit, STEP_CHUNK) for unit in by_unit]


def _chunks(leaves: list[Leaf], size: int) -> list[list[Leaf]]:
    chunks: list[list[Leaf]] = [[]]
    count = 0
    for leaf in leaves:
        if chunks[-1] and count + leaf.numel > size:
            chunks.append([])
            count = 0
        chunks[-1].append(leaf)
        count += leaf.numel
    return [c for c in chunks if c]


@torch.no_grad()
def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t)
    host.grad = torch.zeros(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    return host


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Work queued on `stream` after what the current stream queued so far (nothing to do without CUDA)."""
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(stream)


