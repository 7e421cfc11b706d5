"""The pipeline executor: runs one pipeline rank's action list for one step.

The coordinator's schedule (`parallel.plan.schedule.schedules`) gives each pipeline rank an ordered list of actions;
this module only interprets it, dispatching each action by its kind through one table (`HANDLERS`):
FORWARD/BACKWARD run one micro-batch through one local chunk; BACKWARD_INPUT / BACKWARD_WEIGHT run the two
halves of a split backward (`parallel.runtime.pipeline.split_backward`: the input gradient, then later the weights'); a
run of consecutive communication actions is posted together as one `batch_isend_irecv` and waited on as a whole,
which is the semantics the schedule simulator proves deadlock-free. A kind with no entry raises
`UnsupportedAction` rather than being run as something it is not. Activations and their gradients move
with torch.distributed point-to-point (gloo or NCCL), so the CPU tests run the GPU code path.

With tensor parallelism every tp rank of a stage runs the same actions and talks to the same tp rank of
the neighbouring stage (a pipeline group is one (dp, tp) coordinate), sending what it holds: the whole
activation, or with sequence parallelism its sequence slice (`activation_shape`). The last stage's loss
and its backward run under `loss_context`, which is `loss_parallel` when the head is vocabulary-parallel.

Written by hand rather than with `torch.distributed.pipelining` because the schedule is computed and
simulated by the coordinator as plain data (shown to users before a job runs), and the executor must run
exactly that list; the torch schedules generate and run their own order internally.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.models.components.documents import Documents
from trainyard.parallel.models.components.transfers import to_device
from trainyard.parallel.plan.schedule.actions import (
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    ActionKind,
    stage_location,
    virtual_stage,
)
from trainyard.parallel.runtime.dp.fsdp import ShardedChunks, next_computes
from trainyard.parallel.runtime.pipeline.split_backward import ParamGroups, backward_input, backward_weight
from trainyard.parallel.runtime.pipeline.stage_clock import StageClock

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets) of one micro-batch


@dataclass
class PipelineTimings:
    """What one rank measured while running its actions."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0
    schedule_s: float = 0.0
    """Wall time from the first action to the last."""
    peak_activations: int = 0
    """Most (micro-batch, chunk) activations held at once (forward done, backward not yet)."""
    peak_activation_bytes: int = 0
    """Most bytes autograd held saved for backward at once (parameters excluded), in the last step metered
    (`PipelineExecutor.run`'s `meter`)."""


class UnsupportedAction(ValueError):
    """An action whose kind the executor has no handler for."""


@dataclass
class _StepState:
    batch: Callable[[int], Batch]
    loss_sum: torch.Tensor
    documents: Callable[[int], Documents] | None = None
    """Packed data: micro-batch mb's documents, which every chunk's attention reads (`set_documents`)."""
    timings: PipelineTimings = field(default_factory=PipelineTimings)
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    grads_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    grads_in: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    weight_work: dict[tuple[int, int], ParamGroups | tuple[torch.Tensor, torch.Tensor | None]] = field(
        default_factory=dict)
    """After a split backward's input half: what its weight half needs (virtual stage 0: the output and its
    gradient, for the whole backward)."""
    live: int = 0
    next_compute: list[Action | None] = field(default_factory=list)
    """For each action, the forward or backward after it (what FSDP2 may start gathering)."""


class PipelineExecutor:
    def __init__(self, chunks: list[DecoderStage], pp_rank: int, pp: int, pp_ranks: list[int],
                 activation_shape: tuple[int, ...], device: torch.device, loss_scale: float,
                 loss_context: Callable[[], AbstractContextManager] = nullcontext,
                 autocast: Callable[[], AbstractContextManager] = nullcontext,
                 before_backward: Callable[[Action], None] | None = None, sharded: ShardedChunks | None = None,
                 placement: str = "interleaved"):
        """`activation_shape` is what this rank holds between stages (its sequence slice under sp);
        `loss_context` wraps the last stage's loss and its backward (`loss_parallel` with tp); `autocast`
        wraps every forward and loss (bf16 autocast for `precision: bf16`); `before_backward` is called
        before each backward and each weight-gradient half (the trainer arms the gradient reduction before a
        chunk's last one); `sharded`: the chunks' parameters are sharded by FSDP2 (ZeRO-2/3,
        `parallel.runtime.dp.fsdp`), which is told before each forward and backward which chunk computes now and which
        next, and whose gathered parameters the saved-tensor meter does not count as activations; `placement` is how the
        schedule places virtual stages (`actions.virtual_stage`)."""
        self.chunks, self.pp_rank, self.pp, self.pp_ranks = chunks, pp_rank, pp, pp_ranks
        self.placement = placement
        self.n_virtual = pp * len(chunks)
        self.activation_shape, self.device, self.loss_scale = activation_shape, device, loss_scale
        self.loss_context, self.autocast, self.before_backward = loss_context, autocast, before_backward
        self.sharded = sharded
        self.clock = StageClock(device)
        """The actions' timings: host timers on CPU, CUDA events on a GPU (settled after the step's read)."""
        self.metered_peak = 0
        """`peak_activation_bytes` of the last step run with the saved-tensor meter on."""

    def run(self, actions: list[Action], batch: Callable[[int], Batch],
            documents: Callable[[int], Documents] | None = None, meter: bool = True
            ) -> tuple[torch.Tensor, PipelineTimings]:
        """Run the actions; `batch(mb)` loads micro-batch mb, `documents(mb)` its packed examples (None: not
        packed). Returns this rank's scaled loss sum and timings. Raises UnsupportedAction, before running
        anything, if an action's kind has no handler. `meter`: count the bytes saved for backward (a Python hook
        on every saved tensor, about 2% of a small model's forward on CPU); off, the timings carry the last
        metered step's peak (a step's activations are the same every step of a schedule)."""
        unknown = sorted({a.kind.name for a in actions if a.kind not in HANDLERS})
        if unknown:
            raise UnsupportedAction(f"the pipeline executor has no handler for action kind(s) {', '.join(unknown)} "
                                    f"(it runs {', '.join(k.name for k in HANDLERS)})")
        state = _StepState(batch=batch, loss_sum=torch.zeros((), device=self.device), documents=documents,
                           next_compute=next_computes(actions, lambda a: a.kind in COMPUTE_KINDS))
        counter = _SavedTensorMeter([p for chunk in self.chunks for p in chunk.parameters()], self.sharded) \
            if meter else None
        hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack) if counter else nullcontext()
        with self.clock.span(state.timings, "schedule_s"), hooks:
            i = 0
            while i < len(actions):
                i = HANDLERS[actions[i].kind](self, actions, i, state)
        if counter is not None:
            self.metered_peak = counter.peak
        state.timings.peak_activation_bytes = self.metered_peak
        return state.loss_sum, state.timings

    # Handlers: each runs the action at `i` (a communication handler the whole run from `i`) and returns the
    # index of the next action to run.

    def _run_forward(self, actions: list[Action], i: int, state: _StepState) -> int:
        self._set_documents(actions[i], state)
        with self.clock.span(state.timings, "forward_s"):
            if self.sharded is not None:
                self.sharded.before_compute(actions[i], state.next_compute[i])
            loss = self._forward(actions[i], state, state.batch)
            if loss is not None:
                state.loss_sum += loss.detach()
        state.timings.peak_activations = max(state.timings.peak_activations, state.live)
        return i + 1

    def _run_backward(self, actions: list[Action], i: int, state: _StepState) -> int:
        self._set_documents(actions[i], state)
        with self.clock.span(state.timings, "backward_s"):
            if self.sharded is not None:
                self.sharded.before_compute(actions[i], state.next_compute[i])
            self._backward(actions[i], state)
        state.timings.peak_activations = max(state.timings.peak_activations, state.live)
        return i + 1

    def _run_backward_input(self, actions: list[Action], i: int, state: _StepState) -> int:
        self._set_documents(actions[i], state)
        with self.clock.span(state.timings, "backward_s"):
            if self.sharded is not None and self._virtual(actions[i].chunk) > 0:  # (at 0 it computes nothing)
                self.sharded.before_compute(actions[i], state.next_compute[i])
                self.sharded.gather_chunk(actions[i].chunk)
            self._backward_input(actions[i], state)
        return i + 1

    def _run_backward_weight(self, actions: list[Action], i: int, state: _StepState) -> int:
        self._set_documents(actions[i], state)
        a = actions[i]
        # At virtual stage 0 the weight half is the whole backward, through FSDP2's hooks; elsewhere it passes none
        # of them, and the units are gathered and their gradients reduced around it (`parallel.runtime.dp.fsdp_split`).
        whole = self._virtual(a.chunk) == 0
        with self.clock.span(state.timings, "backward_s"):
            if self.sharded is not None and whole:
                self.sharded.before_compute(a, state.next_compute[i])
            elif self.sharded is not None:
                self.sharded.before_weight(a)
            self._backward_weight(a, state)
            if self.sharded is not None and not whole:
                self.sharded.after_weight(a.chunk)
        return i + 1

    def _run_communication(self, actions: list[Action], i: int, state: _StepState) -> int:
        j = i
        while j < len(actions) and actions[j].kind in COMM_KINDS:
            j += 1
        with self.clock.span(state.timings, "comm_s"):
            self._communicate(actions[i:j], state)
        return j

    def _set_documents(self, a: Action, state: _StepState) -> None:
        """Packed data: the chunk reads micro-batch a's documents, before its forward and before each backward
        action, whose recompute (activation checkpointing) re-runs the forward of that micro-batch."""
        if state.documents is not None:
            self.chunks[a.chunk].set_documents(state.documents(a.microbatch))

    def _virtual(self, chunk: int) -> int:
        return virtual_stage(self.pp_rank, chunk, self.pp, self.placement)

    def _local_neighbour(self, v: int) -> int | None:
        """The local chunk holding virtual stage v if this rank holds it (then tensors are handed over
        locally: always with pp == 1, and at the turn of a V), else None."""
        rank, chunk = stage_location(v, self.pp, self.placement)
        return chunk if rank == self.pp_rank else None

    def _forward(self, a: Action, state: _StepState, batch: Callable[[int], Batch]) -> torch.Tensor | None:
        key, v = (a.microbatch, a.chunk), self._virtual(a.chunk)
        if v == 0:
            x = to_device(batch(a.microbatch)[0], self.device)
        elif (previous := self._local_neighbour(v - 1)) is not None:  # on this rank: pass it locally
            x = state.outputs[(a.microbatch, previous)].detach().requires_grad_()
        else:
            x = state.inputs[key]
        state.inputs[key] = x
        with self.autocast():
            out = self.chunks[a.chunk](x)
        state.live += 1
        if v == self.n_virtual - 1:
            targets = to_device(batch(a.microbatch)[1], self.device)
            with self.loss_context(), self.autocast():
                out = self.chunks[a.chunk].loss_sum(out, targets) * self.loss_scale
            state.outputs[key] = out
            return out
        state.outputs[key] = out
        return None

    def _backward(self, a: Action, state: _StepState) -> None:
        if self.before_backward is not None:
            self.before_backward(a)
        key, v = (a.microbatch, a.chunk), self._virtual(a.chunk)
        out = state.outputs.pop(key)
        if v == self.n_virtual - 1:
            with self.loss_context():
                out.backward()
        else:
            out.backward(state.grads_out.pop(key))
        x = state.inputs.pop(key)
        state.live -= 1
        if v > 0:
            assert x.grad is not None  # a received or handed-over activation, which requires grad and fed `out`
            self._input_grad(a, v, x.grad, state)

    def _input_grad(self, a: Action, v: int, grad: torch.Tensor, state: _StepState) -> None:
        """Hand the gradient of a chunk's input to the previous virtual stage: locally, or to be sent."""
        previous = self._local_neighbour(v - 1)
        if previous is not None:
            state.grads_out[(a.microbatch, previous)] = grad
        else:
            state.grads_in[(a.microbatch, a.chunk)] = grad

    def _backward_input(self, a: Action, state: _StepState) -> None:
        key, v = (a.microbatch, a.chunk), self._virtual(a.chunk)
        out, x = state.outputs.pop(key), state.inputs.pop(key)
        grad = None if v == self.n_virtual - 1 else state.grads_out.pop(key)
        if v == 0:  # no input gradient to compute: the weight half runs the whole backward
            state.weight_work[key] = (out, grad)
            return
        with self.loss_context() if grad is None else nullcontext():
            dx, groups = backward_input(out, grad, x, _trainable(self.chunks[a.chunk]))
        state.weight_work[key] = groups
        self._input_grad(a, v, dx, state)

    def _backward_weight(self, a: Action, state: _StepState) -> None:
        if self.before_backward is not None:
            self.before_backward(a)
        key, v = (a.microbatch, a.chunk), self._virtual(a.chunk)
        work = state.weight_work.pop(key)
        last = v == self.n_virtual - 1
        with self.loss_context() if last else nullcontext():
            if isinstance(work, tuple):
                out, grad = work
                out.backward(grad)
            else:
                chunk = self.chunks[a.chunk]
                backward_weight(work, _trainable(chunk), one_call=chunk.recompute_blocks)
        state.live -= 1

    def _communicate(self, actions: list[Action], state: _StepState) -> None:
        ops, received = [], []
        for a in actions:
            assert a.peer is not None  # every communication action names its peer stage
            key, peer = (a.microbatch, a.chunk), self.pp_ranks[a.peer]
            if a.kind is ActionKind.SEND_ACT:
                ops.append(dist.P2POp(dist.isend, state.outputs[key].detach().contiguous(), peer))
            elif a.kind is ActionKind.SEND_GRAD:
                ops.append(dist.P2POp(dist.isend, state.grads_in.pop(key).contiguous(), peer))
            else:
                buffer = torch.empty(self.activation_shape, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, peer))
                received.append((a, buffer))
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        for a, buffer in received:
            if a.kind is ActionKind.RECV_ACT:
                state.inputs[(a.microbatch, a.chunk)] = buffer.requires_grad_()
            else:
                state.grads_out[(a.microbatch, a.chunk)] = buffer


class _SavedTensorMeter:
    """Counts the bytes autograd keeps for backward, live at once, via saved-tensor hooks.

    Bytes are counted per storage, once however many saved tensors refer to it (q, k and v each save the
    same input; a view keeps its whole storage alive). Storages of parameters are skipped: they are held
    anyway, whatever the schedule. A DTensor counts what this rank really holds, its local shard. Parameters
    FSDP2 gathered (`sharded`) are skipped too: they are counted as gathered parameters, and freed after the
    chunk's compute whatever autograd saved.
    """

    def __init__(self, params: list[torch.Tensor], sharded: ShardedChunks | None = None):
        self.param_storage = {_local(p).untyped_storage().data_ptr() for p in params}
        self.sharded = sharded
        self.storages: dict[int, list[int]] = {}
        """Address of each storage held -> [saved tensors referring to it, its bytes]."""
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor | _Counted:
        storage = _local(t).untyped_storage()
        gathered = self.sharded.gathered if self.sharded is not None else ()
        if storage.data_ptr() in self.param_storage or storage.data_ptr() in gathered:
            return t
        # Detached: a node's own output saved with its history would keep the node alive through this hook
        # (node -> packed -> tensor -> node), a cycle no garbage collector sees; the backward releases it when
        # the node runs, but a split backward's input half keeps the graph, and its weight half never runs the
        # input path's nodes. Autograd rebuilds the history on unpack.
        return _Counted(t.detach(), storage.data_ptr(), storage.nbytes(), self)

    def unpack(self, packed: torch.Tensor | _Counted) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Counted) else packed

    def hold(self, key: int, nbytes: int) -> None:
        entry = self.storages.setdefault(key, [0, nbytes])
        entry[0] += 1
        if entry[0] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def release(self, key: int) -> None:
        entry = self.storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.storages[key]
            self.live -= entry[1]


class _Counted:
    """A saved tensor the meter counts while autograd keeps it (a live one keeps its storage's address)."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, key: int, nbytes: int, meter: _SavedTensorMeter):
        self.tensor, self.meter, self.key = tensor, meter, key
        meter.hold(key, nbytes)

    def __del__(self):
        self.meter.release(self.key)


def _trainable(chunk: nn.Module) -> list[nn.Parameter]:
    """The parameters a backward's weight half computes gradients for: not a frozen one (LoRA's base)."""
    return [p for p in chunk.parameters() if p.requires_grad]


def _local(t: torch.Tensor) -> torch.Tensor:
    # The attribute, not `to_local()`: a saved-tensor hook must not record autograd operations.
    t = t._local_tensor if isinstance(t, DTensor) else t
    # A collective's lazily waited output (e.g. the vocabulary-parallel embedding's reduce-scatter that a
    # sequence-parallel norm takes as is) holds its data in `elem`; the wrapper has no storage of its own.
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


HANDLERS: dict[ActionKind, Callable[[PipelineExecutor, list[Action], int, _StepState], int]] = {
    ActionKind.FORWARD: PipelineExecutor._run_forward,
    ActionKind.BACKWARD: PipelineExecutor._run_backward,
    ActionKind.BACKWARD_INPUT: PipelineExecutor._run_backward_input,
    ActionKind.BACKWARD_WEIGHT: PipelineExecutor._run_backward_weight,
    **{kind: PipelineExecutor._run_communication for kind in COMM_KINDS},
}
"""Each action kind the executor runs -> its handler. A kind missing here is refused (UnsupportedAction)."""

