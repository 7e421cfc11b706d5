"""ZeRO-2 and ZeRO-3 (`parallel.zero: 2 | 3`) with torch's FSDP2 (`fully_shard`), driven by the pipeline's schedule.

`shard_chunks` hands every pipeline chunk of a rank to FSDP2 as a root of its own, on the data-parallel
dimension of the world mesh (`parallel.runtime.distributed`), so a tensor-parallel DTensor parameter becomes a 2-D
(dp, tp) DTensor and a plain one a 1-D (dp) DTensor, sharded along its first dimension. An MoE block's router
and each of its experts are wrapped apart, on a 1-D mesh made of their own reduction group (the router: the
stage's dp x tp ranks; experts: the ranks holding the same experts; see `parallel.models.moe`), so every set of
gradients is summed over the ranks that computed it, as the hand-written reducers do at zero 0 and 1. A set
whose group is this rank alone is left out of FSDP (`ignored_params`) and reduced by a plain
`GradientReducer` (which then sends nothing). FSDP2 does the sharding, the gathers, the reduce-scatters (in
`reduce_dtype` on the wire), the sharded gradients the optimizer updates, and the DTensors DCP checkpoints
under the unsharded model's names and shapes, so a checkpoint stays layout-independent.

What is ours, and why:
- the loss is already normalised by the global token count, so the gradient wanted is the SUM over the group:
  `set_gradient_divide_factor(1)`, and `set_force_sum_reduction_for_comms` because FSDP2 would otherwise send
  a factor of 1 as `ReduceOp.PREMUL_SUM`, which gloo refuses;
- the head's loss runs in `loss_sum`, outside `forward`: registered with `register_fsdp_forward_method`;
- when to gather: FSDP2 knows module order, not the coordinator's schedule, in which a rank's chunks and
  micro-batches interleave. The pipeline executor calls `before_compute(action, next_action)` before each
  forward and backward: this chunk is gathered (waiting for its prefetch, if one is in flight) and the gather
  of the chunk the schedule computes next is started (`unshard(async_op=True)`), so it overlaps this compute;
- when to free: ZeRO-3 frees a chunk after each forward and backward (`reshard_after_forward=True`); ZeRO-2
  keeps it whole from its first forward of the step to its last backward, which only the schedule knows:
  `arm(chunk)` (the trainer's `before_backward`, as for the overlapped reducers) turns FSDP2's
  `reshard_after_backward` on just for that backward;
- micro-batch accumulation: `requires_gradient_sync` stays on, so each micro-batch's backward of a chunk
  reduce-scatters its gradients and FSDP2 adds them to the shard (DeepSpeed stage 2's scheme): a whole
  gradient exists only for the chunk whose backward is running, never across the step.

FSDP2's private per-module state (`_param_groups`: each group's `fsdp_params` with their `all_gather_outputs`,
and `_all_gather_result`, a gather in flight) is read in `ShardedChunks._refresh` and `_sample` only, to know
which storages hold gathered parameters right now: the pipeline's saved-tensor meter must not count them as
activations, and `peak_gathered_bytes` is what the memory plan's gathered chunks are checked against.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from trainyard.parallel.models.moe import moe_layers
from trainyard.parallel.plan.actions import Action, ActionKind
from trainyard.parallel.plan.sharding import Sharding

WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}

# The executor never changes a chunk's output in place, which is what FSDP2's warning is about.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class ShardedChunks:
    """A rank's chunks handed to FSDP2: which modules are wrapped, and the schedule's calls into them."""

    def __init__(self, chunks: list[nn.Module], roots: list[FSDPModule | None], nested: list[list[FSDPModule]],
                 sharding: Sharding):
        """`roots[c]`: chunk c wrapped on the dp mesh (None when dp = 1); `nested[c]`: its routers and experts
        wrapped on their own groups."""
        self.chunks, self.roots, self.sharding = chunks, roots, sharding
        self.wrapped = [m for c, root in enumerate(roots) for m in ([root] if root is not None else []) + nested[c]]
        # What the step's calls go to: a chunk's root (they recurse into what it holds), else its nested modules.
        self.tops = [[root] if root is not None else nested[c] for c, root in enumerate(roots)]
        self.backwards = [0] * len(chunks)
        """Backwards of each chunk in this step: each one reduce-scatters the chunk's gradients (`wire_bytes`)."""
        self.peak_gathered_bytes = 0
        """Most bytes of gathered parameters (whole, or in flight) held at once in the last step."""
        self.gathered: set[int] = set()
        """Addresses of the storages holding gathered (whole) parameters: what the saved-tensor meter skips."""
        self._storages: dict[FSDPModule, dict[int, int]] = {}
        self._held = 0
        for module in self.wrapped:  # after FSDP2's own hooks: its pre-forward gathers, its post-forward frees
            module.register_forward_pre_hook(self._changed)
            module.register_forward_hook(self._changed)

    def _changed(self, module: FSDPModule, *_: object) -> None:
        self._refresh(module)
        self._sample(self.roots)

    def _refresh(self, module: FSDPModule) -> None:
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

    def _sample(self, modules: Iterable[FSDPModule | None]) -> None:
        """The peak so far, with the buffers of gathers in flight on `modules`."""
        in_flight = sum(group._all_gather_result.all_gather_output.untyped_storage().nbytes()
                        for module in modules if module is not None for group in _param_groups(module)
                        if group._all_gather_result is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._held + in_flight)

    def start_step(self) -> None:
        """Before a step: everything sharded (an evaluation may have left ZeRO-2's chunks whole), and ZeRO-2's
        chunks kept whole after each backward until `arm` says the next one is their last."""
        self.reshard()
        for module in (m for top in self.tops for m in top):
            module.set_reshard_after_backward(self.sharding.reshard_after_forward)
        self.backwards = [0] * len(self.chunks)
        self.peak_gathered_bytes = 0

    def arm(self, chunk: int) -> None:
        """The next backward of `chunk` is its last in this step: free its parameters after it."""
        for module in self.tops[chunk]:
            module.set_reshard_after_backward(True)

    def before_compute(self, action: Action, next_action: Action | None) -> None:
        """Before a forward or backward of `action.chunk`: gather it (a no-op when it is whole already) and start
        gathering the chunk the schedule computes next, if that is another one. Then every module is looked at
        again (a backward frees without a forward hook)."""
        if action.kind is ActionKind.BACKWARD:
            self.backwards[action.chunk] += 1
        root = self.roots[action.chunk]
        if root is not None:
            root.unshard()
        if next_action is not None and next_action.chunk != action.chunk:
            following = self.roots[next_action.chunk]
            if following is not None:
                following.unshard(async_op=True)  # FSDP2 waits for it in that chunk's own unshard
        for module in self.wrapped:
            self._refresh(module)
        self._sample(self.wrapped)

    def reshard(self) -> None:
        """Free every gathered parameter (`reshard` does not recurse: each wrapped module)."""
        for module in self.wrapped:
            module.reshard()
            self._refresh(module)


def _param_groups(module: FSDPModule) -> list:
    # Private FSDP2 state (torch 2.13): a wrapped module's parameter groups, each with its `fsdp_params`
    # (whose `all_gather_outputs` hold the gathered parameter) and the all-gather in flight.
    return fully_shard.state(module)._fsdp_param_groups


def shard_chunks(chunks: Sequence[nn.Module], dp_mesh: DeviceMesh | None, router_group: dist.ProcessGroup | None,
                 expert_group: dist.ProcessGroup | None, sharding: Sharding, reduce_dtype: str) -> ShardedChunks:
    """Wrap each chunk (and its MoE routers and experts) with `fully_shard`, each set on the mesh of the ranks
    that reduce it; a set reduced by this rank alone stays unwrapped."""
    device = next(p for chunk in chunks for p in chunk.parameters()).device.type
    router_mesh, expert_mesh = _mesh(router_group, device), _mesh(expert_group, device)
    kwargs = {"reshard_after_forward": sharding.reshard_after_forward,
              "mp_policy": MixedPrecisionPolicy(reduce_dtype=WIRE_DTYPES[reduce_dtype])}
    roots: list[FSDPModule | None] = []
    nested: list[list[FSDPModule]] = []

    def wrap(module: nn.Module, mesh: DeviceMesh, **extra: object) -> FSDPModule:
        fsdp = fully_shard(module, mesh=mesh, **kwargs, **extra)
        fsdp.set_gradient_divide_factor(1.0)
        fsdp.set_force_sum_reduction_for_comms(True)
        return fsdp

    for chunk in chunks:
        ignored: set[nn.Parameter] = set()
        nested.append([])
        for _, layer in moe_layers(chunk):
            for module, mesh in [(layer.router, router_mesh), *((e, expert_mesh) for e in layer.experts.values())]:
                if mesh is not None:
                    nested[-1].append(wrap(module, mesh))
                else:
                    ignored.update(module.parameters())
        if dp_mesh is None:
            roots.append(None)
            continue
        roots.append(wrap(chunk, dp_mesh, ignored_params=ignored or None))
        register_fsdp_forward_method(chunk, "loss_sum")
    return ShardedChunks(chunks, roots, nested, sharding)


def _mesh(group: dist.ProcessGroup | None, device: str) -> DeviceMesh | None:
    return DeviceMesh.from_group(group, device) if group is not None else None


class FsdpReducer:
    """One set of parameters (dense, routers or experts) that FSDP2 shards: the reducer's interface
    (`parallel.runtime.data_parallel.GradientReducer`) over FSDP2's sharded parameters and gradients. FSDP2 reduces
    during backward; the step and the checkpoint work on the shards, which are the parameters themselves."""

    zero = True
    holders = 1
    """Each reduced gradient element is held by one rank of the group: its shard's."""
    started_early = 0

    def __init__(self, chunk_params: list[list[nn.Parameter]], sharded: ShardedChunks, reduce_dtype: str):
        self.params = [p for params in chunk_params for p in params]
        self.sharded = sharded
        itemsize = (WIRE_DTYPES[reduce_dtype] or torch.float32).itemsize
        # What one backward of each chunk hands to its reduce-scatters: the gradients of the rank's (tp-local)
        # parameters, whole: the shard's elements times the group's size (dim 0 of the parameter's mesh).
        self._chunk_wire = [sum(_local(p).numel() * p.device_mesh.size(0) for p in params) * itemsize
                            for params in chunk_params]

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank handed to its reduce-scatters in the last step: every backward of a chunk sends the
        chunk's whole local gradients (the parameter all-gathers are not counted)."""
        return sum(n * b for n, b in zip(self.sharded.backwards, self._chunk_wire, strict=True))

    @property
    def buckets(self) -> list:
        """None of the hand-written reducers' buckets: FSDP2 keeps the gradients."""
        return []

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.sharded.start_step()

    def arm(self, chunk: int) -> None:
        self.sharded.arm(chunk)

    def finish(self) -> None:
        """Nothing left: FSDP2 waited for every reduce-scatter at the end of each backward."""

    def held_grads(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [(_local(p.grad), p) for p in self.params if p.grad is not None]

    @staticmethod
    def tp_copies(p: torch.Tensor, tp: int) -> int:
        """tp ranks holding the same local gradient: 1 if `p` is sharded over the mesh's tp dimension."""
        names = p.device_mesh.mesh_dim_names or ()
        return 1 if any(n == "tp" and pl.is_shard() for n, pl in zip(names, p.placements, strict=True)) else tp

    def optimizer_params(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [(p, p) for p in self.params]

    def moments(self, optimizer: torch.optim.Optimizer, keys: tuple[str, ...]) -> dict[nn.Parameter, dict]:
        """Each parameter's state: sharded like the parameter, so DCP saves it under the unsharded shape."""
        return {p: {k: optimizer.state[p][k] for k in keys} for p in self.params}

    def load_moments(self, optimizer: torch.optim.Optimizer, moments: dict[nn.Parameter, dict]) -> None:
        """The state's tensors were filled in place: nothing to do."""

    def gather_params(self) -> None:
        """Nothing: the next forward gathers what it needs."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def next_computes(actions: list[Action], is_compute: Callable[[Action], bool]) -> list[Action | None]:
    """For each action, the next compute action after it in the list (None for the last)."""
    out: list[Action | None] = [None] * len(actions)
    following = None
    for i in range(len(actions) - 1, -1, -1):
        out[i] = following
        if is_compute(actions[i]):
            following = actions[i]
    return out
