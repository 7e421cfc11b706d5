"""ZeRO-2 and ZeRO-3 (`parallel.zero: 2 | 3`) with torch's FSDP2 (`fully_shard`), per block, driven by the pipeline's
schedule.

`shard_chunks` wraps, inside every pipeline chunk of a rank, each unit the model family names
(`DecoderStage.shard_units`: the embedding, each transformer block, the head) with FSDP2 on the data-parallel
dimension of the world mesh (`parallel.runtime.distributed`), so a tensor-parallel DTensor parameter becomes a 2-D
(dp, tp) DTensor and a plain one a 1-D (dp) DTensor, sharded along its first dimension; the chunk itself is then
wrapped as the root of its units (it holds no parameter of its own). An MoE block's router and each of its
experts are wrapped apart, inside their block, on a 1-D mesh made of their own reduction group (the router: the
stage's dp x tp ranks; experts: the ranks holding the same experts; see `parallel.models.components.moe`), so every set
of gradients is summed over the ranks that computed it, as the hand-written reducers do at zero 0 and 1. A set
whose group is this rank alone is left out of FSDP (`ignored_params`) and reduced by a plain `GradientReducer`
(which then sends nothing). FSDP2 does the sharding, the gathers, the reduce-scatters (in `reduce_dtype` on the
wire; on gloo `gloo_comms`' collectives, without gloo's whole copies), the sharded gradients the optimizer
updates, and the DTensors DCP checkpoints under the unsharded model's names and shapes (layout-independent).

Gathering one unit at a time: each unit's FSDP2 pre-forward (pre-backward) hook gathers it and, through FSDP2's
explicit prefetch lists (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`), starts the gather
of the unit that runs after it, so a block's gather overlaps the compute of the one before it, in forward and in
backward. At ZeRO-3 each unit is freed after its forward and after its backward, so a rank holds at most the unit
computing and the next one's gather: two blocks, or a block and the embedding or the head, never a chunk
(`parallel.plan.memory.estimate` counts that pair; `peak_gathered_bytes` measures it). The gathers are issued with
`async_op` (`_set_unshard_async_op`): they then overlap compute on gloo too, and FSDP2 keeps no copy of a unit's
all-gather buffer after copying it out (with `async_op=False` it keeps the last one for its stream overlap).

What is ours, and why:
- the loss is already normalised by the global token count, so the gradient wanted is the SUM over the group:
  `set_gradient_divide_factor(1)`, and `set_force_sum_reduction_for_comms` because FSDP2 would otherwise send
  a factor of 1 as `ReduceOp.PREMUL_SUM`, which gloo refuses;
- the head's loss runs in `loss_sum`, outside `forward`: registered with `register_fsdp_forward_method`;
- which unit runs next across actions: FSDP2 knows module order, not the coordinator's schedule, in which a
  rank's chunks, micro-batches, forwards and backwards interleave (and its implicit backward prefetch, from the
  order of the forwards since the last backward, mistargets in a pipeline, so every unit gets an explicit list).
  The pipeline executor calls `before_compute(action, next_action)` before each forward and backward: the unit
  this action runs last is pointed at the unit the next compute action runs first (the first of its chunk's units
  for a forward, the last for a backward), so that gather starts while this action's last unit computes;
- when the next compute runs first the unit this one runs last (the head from a forward to its backward at the
  last stage, the embedding or first block from a backward to the next forward), ZeRO-3 keeps that unit whole in
  between (`set_reshard_after_forward` / `set_reshard_after_backward` for that action) rather than free it and
  gather it again at once;
- a chunk's backwards before its last in the step are not FSDP2's "last backward" (`set_is_last_backward`):
  FSDP2 would end each by dropping the gather prefetched for the chunk's next backward; `arm` sets it for the
  last, which waits for the reductions, as FSDP2's micro-batching expects;
- a unit that runs twice in one forward (tied embeddings: the embedding first, the head last) has no list that
  fits both runs: it prefetches nothing and is gathered when it runs;
- when to free: ZeRO-3 frees a unit after each forward and backward (`reshard_after_forward=True`); ZeRO-2
  keeps it whole from its first forward of the step to its chunk's last backward, which only the schedule knows:
  `arm(chunk)` (the trainer's `before_backward`, as for the overlapped reducers) turns FSDP2's
  `reshard_after_backward` on for the chunk's units just for that backward;
- micro-batch accumulation: `requires_gradient_sync` stays on, so each micro-batch's backward of a unit
  reduce-scatters its gradients and FSDP2 adds them to the shard (DeepSpeed stage 2's scheme): a whole gradient
  exists only for the block whose backward is running, at ZeRO-2 as at ZeRO-3.

FSDP2's private state is used in three places: each root is initialised at construction, once its parameters
hold values (`ready`: `_lazy_init`, which its first forward would run), so a gather prefetched into a chunk that
has not run yet finds its units ready;
`_set_unshard_async_op` (above); and `parallel.runtime.dp.fsdp_meter`, which measures what is gathered.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.models.components.moe import moe_layers
from trainyard.parallel.plan.schedule.actions import Action, ActionKind
from trainyard.parallel.plan.sharding import Sharding
from trainyard.parallel.runtime.dp.fsdp_meter import GatheredMeter
from trainyard.parallel.runtime.dp.fsdp_split import gather_split, reduce_after_weight
from trainyard.parallel.runtime.dp.gloo_comms import BroadcastAllGather, InPlaceReduceScatter
from trainyard.parallel.runtime.dp.grad_buckets import WIRE_DTYPES
from trainyard.parallel.runtime.tp.local_parts import local_part

# The executor never changes a chunk's output in place, which is what FSDP2's warning is about.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class ShardedChunks:
    """A rank's chunks handed to FSDP2 per block: which modules are wrapped, and the schedule's calls into them."""

    def __init__(self, chunks: Sequence[nn.Module], roots: list[FSDPModule | None], orders: list[list[FSDPModule]],
                 nested: list[list[FSDPModule]], members: dict[FSDPModule, list[nn.Module]], sharding: Sharding):
        """`roots[c]`: chunk c wrapped on the dp mesh (None when dp = 1); `orders[c]`: its units (embedding,
        blocks, head) in the order its forward runs them, a unit that runs twice listed twice (empty when dp = 1);
        `nested[c]`: its routers and experts, wrapped on their own groups; `members`: each unit or nested module
        -> the modules it was made of."""
        self.chunks, self.roots, self.orders, self.sharding = chunks, roots, orders, sharding
        self.nested = nested
        units = [m for order in orders for m in dict.fromkeys(order)]
        self.wrapped = [*(r for r in roots if r is not None), *units, *(m for ms in nested for m in ms)]
        # What the step's calls go to: a chunk's root (they recurse into what it holds), else its nested modules.
        self.tops = [[root] if root is not None else nested[c] for c, root in enumerate(roots)]
        self.backwards = [0] * len(chunks)
        """Backwards of each chunk in this step: each one reduce-scatters the chunk's gradients (`wire_bytes`)."""
        self._kept: tuple[FSDPModule, ActionKind] | None = None
        """ZeRO-3: the unit the current action keeps whole for the next one, which runs it first."""
        self._once = [{u for u in order if order.count(u) == 1} for order in orders]
        for c in range(len(chunks)):
            self._wire(c)
        self.meter = GatheredMeter(self.wrapped, self._neighbourhoods(), members)

    @property
    def gathered(self) -> set[int]:
        """Addresses of the storages holding gathered (whole) parameters now: what the saved-tensor meter skips."""
        return self.meter.gathered

    @property
    def peak_gathered_bytes(self) -> int:
        """Most bytes of gathered parameters (whole, or in flight) held at once in the last step."""
        return self.meter.peak_gathered_bytes

    def _neighbourhoods(self) -> dict[FSDPModule, list[FSDPModule]]:
        """Each unit (or nested module) -> the wrapped modules whose state may change while it runs: its unit,
        the units next to it in its chunk's order (the one just freed, the one being gathered), and the routers
        and experts inside them."""
        near: dict[FSDPModule, list[FSDPModule]] = {}
        for order, nested in zip(self.orders, self.nested, strict=True):
            inside = {u: [n for n in nested if any(n is m for m in _module(u).modules())] for u in order}
            for k, unit in enumerate(order):
                around = [v for v in order[max(0, k - 1):k + 2] for v in (v, *inside[v])]
                near[unit] = list(dict.fromkeys(near.get(unit, []) + around))
            for n in nested:
                near[n] = next((near[u] for u in order if n in inside[u]), [n])
        return near

    def _wire(self, c: int) -> None:
        """FSDP2's prefetch lists inside chunk c: each unit gathers the next one in forward and the one before it
        in backward. Every unit gets a backward list, at worst itself (a no-op): with none, FSDP2 guesses from the
        order of the forwards since the last backward, which a pipeline interleaves."""
        order, once = self.orders[c], self._once[c]
        for k, unit in enumerate(order):
            if unit not in once:
                unit.set_modules_to_backward_prefetch([unit])
                continue
            if k + 1 < len(order):
                unit.set_modules_to_forward_prefetch([order[k + 1]])
            unit.set_modules_to_backward_prefetch([order[k - 1] if k > 0 else unit])
        for module in self.nested[c]:
            module.set_modules_to_backward_prefetch([module])

    def ready(self) -> None:
        """Once the parameters hold their values (`parallel.runtime.materialize`: the chunks are wrapped on the meta
        device, and FSDP2 refuses to initialise meta parameters): what each root's first forward does (see the
        module docstring). contract() sets `.state` on fully_shard at run time; the stubs' overloads do not
        declare it."""
        for root in self.roots:
            if root is not None:
                fully_shard.state(root)._lazy_init()  # type: ignore[attr-defined]

    def start_step(self) -> None:
        """Before a step: everything sharded (an evaluation may have left ZeRO-2's units whole), ZeRO-2's
        units kept whole after each backward until `arm` says the next one is their chunk's last, and no backward
        taken for its chunk's last (FSDP2 would then drop a gather prefetched for the chunk's next backward)."""
        self._keep(None)
        self.reshard()
        for module in (m for top in self.tops for m in top):
            module.set_reshard_after_backward(self.sharding.reshard_after_forward)
        for root in self.roots:
            if root is not None:
                root.set_is_last_backward(False)
        self.backwards = [0] * len(self.chunks)
        self.meter.reset()

    def arm(self, chunk: int) -> None:
        """The next backward of `chunk` is its last in this step: free its units' parameters after it, and let
        FSDP2 finish the chunk's backward there (wait for its reductions, drop what nothing will use)."""
        for module in self.tops[chunk]:
            module.set_reshard_after_backward(True)
        root = self.roots[chunk]
        if root is not None:
            root.set_is_last_backward(True)

    def before_compute(self, action: Action, next_action: Action | None) -> None:
        """Before a forward or backward of `action.chunk`: point the unit it runs last at the unit the next compute
        runs first (FSDP2 gathers the units of this action from their own hooks). Then every module is looked at
        again (a backward's last unit is freed without a hook of ours)."""
        if action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):  # where gradients are reduced
            self.backwards[action.chunk] += 1
        target = self.meter.target = self._runs_first(next_action)
        order, once = self.orders[action.chunk], self._once[action.chunk]
        last = (order[-1] if action.kind is ActionKind.FORWARD else order[0]) if order else None
        if last is not None and last not in once:
            last = None
        if last is not None and action.kind is ActionKind.FORWARD:
            last.set_modules_to_forward_prefetch([] if target is None else [target])
        elif last is not None:
            last.set_modules_to_backward_prefetch([target or last])
        self._keep((last, action.kind) if last is not None and last is target else None)
        self.meter.look_all()

    def gather_chunk(self, chunk: int) -> None:
        """Before either half of a split backward (not at virtual stage 0, whose weight half is a whole backward):
        the chunk's units whole, so its parameters are the ones the graph holds (`parallel.runtime.dp.fsdp_split`)."""
        gather_split(self.orders[chunk] + self.nested[chunk])
        self.meter.look_all()

    def before_weight(self, action: Action) -> None:
        """Before a split backward's weight half: where the chunk's gradients are reduced."""
        self.backwards[action.chunk] += 1
        self._keep(None)
        self.gather_chunk(action.chunk)

    def after_weight(self, chunk: int) -> None:
        """After it: the units' gradients reduce-scattered, the units freed as the flags say."""
        reduce_after_weight(self.tops[chunk])
        self.meter.look_all()

    def _keep(self, kept: tuple[FSDPModule, ActionKind] | None) -> None:
        """ZeRO-3: keep whole, after this action, the unit it runs last when the next compute runs it first (the
        head from a forward to its backward, the embedding or a block from a backward to the next forward) rather
        than free it and gather it again; the unit the last action kept is freed as usual again."""
        if not self.sharding.reshard_after_forward:
            return  # ZeRO-2 keeps every unit whole until its chunk's last backward anyway
        if self._kept is not None:
            unit, kind = self._kept
            if kind is ActionKind.FORWARD:
                unit.set_reshard_after_forward(True, recurse=False)
            else:
                unit.set_reshard_after_backward(True, recurse=False)
        self._kept = kept
        if kept is not None:
            unit, kind = kept
            if kind is ActionKind.FORWARD:
                unit.set_reshard_after_forward(False, recurse=False)
            else:
                unit.set_reshard_after_backward(False, recurse=False)

    def _runs_first(self, action: Action | None) -> FSDPModule | None:
        """The unit a compute action runs first: its chunk's first unit for a forward, its last for a backward."""
        if action is None or not self.orders[action.chunk]:
            return None
        order = self.orders[action.chunk]
        return order[0] if action.kind is ActionKind.FORWARD else order[-1]

    def reshard(self) -> None:
        """Free every gathered parameter (`reshard` does not recurse: each wrapped module)."""
        for module in self.wrapped:
            module.reshard()
            self.meter.refresh(module)


def shard_chunks(chunks: Sequence[DecoderStage], dp_mesh: DeviceMesh | None, router_group: dist.ProcessGroup | None,
                 expert_group: dist.ProcessGroup | None, sharding: Sharding, reduce_dtype: str,
                 device_type: str) -> ShardedChunks:
    """Wrap each chunk's units (`shard_units`: embedding, blocks, head) and its MoE routers and experts with
    `fully_shard`, each set on the mesh of the ranks that reduce it, then the chunk as their root; a set reduced
    by this rank alone stays unwrapped. The chunks may be on the meta device (`device_type`: the device they will
    be materialized on, which the meshes name); `ready` then follows their materialization."""
    router_mesh, expert_mesh = _mesh(router_group, device_type), _mesh(expert_group, device_type)
    reshard, wire = sharding.reshard_after_forward, WIRE_DTYPES[reduce_dtype]
    mp_policy = MixedPrecisionPolicy(reduce_dtype=None if wire == torch.float32 else wire)  # fp32: FSDP2's default
    roots: list[FSDPModule | None] = []
    orders: list[list[FSDPModule]] = []
    nested: list[list[FSDPModule]] = []
    members: dict[FSDPModule, list[nn.Module]] = {}

    def wrap(modules: list[nn.Module], mesh: DeviceMesh, ignored: set[nn.Parameter] | None = None) -> FSDPModule:
        if len(modules) > 1:
            fully_shard(modules, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, ignored_params=ignored)
        else:
            fully_shard(modules[0], mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                        ignored_params=ignored)
        fsdp = modules[0]  # a unit of several modules shares one FSDP2 state: any of them stands for it
        assert isinstance(fsdp, FSDPModule)  # fully_shard made its class a subclass of FSDPModule
        fsdp.set_gradient_divide_factor(1.0)
        fsdp.set_force_sum_reduction_for_comms(True)
        fsdp._set_unshard_async_op(True)
        if dist.get_backend(mesh.get_group()) == "gloo":  # its collectives copy the whole buffer first
            fsdp.set_custom_all_gather(BroadcastAllGather())
            fsdp.set_custom_reduce_scatter(InPlaceReduceScatter())
        members[fsdp] = modules
        return fsdp

    for chunk in chunks:
        ignored: set[nn.Parameter] = set()
        nested.append([])
        for _, layer in moe_layers(chunk):
            for module, mesh in [(layer.router, router_mesh), *((e, expert_mesh) for e in layer.experts.values())]:
                if mesh is not None:
                    nested[-1].append(wrap([module], mesh))
                else:
                    ignored.update(module.parameters())
        if dp_mesh is None:
            roots.append(None)
            orders.append([])
            continue
        units: dict[int, FSDPModule] = {}  # a unit listed twice (tied embeddings) is wrapped once
        listed = chunk.shard_units()
        for unit in listed:
            if id(unit) not in units:
                units[id(unit)] = wrap(unit, dp_mesh, ignored or None)
        orders.append([units[id(unit)] for unit in listed])
        root = fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                           ignored_params=ignored or None)
        register_fsdp_forward_method(chunk, "loss_sum")
        roots.append(root)
    return ShardedChunks(chunks, roots, orders, nested, members, sharding)


def _module(unit: FSDPModule) -> nn.Module:
    """A wrapped unit as the module it is: fully_shard gives it a class deriving from both FSDPModule and its own."""
    assert isinstance(unit, nn.Module)
    return unit


def _dtensor(p: torch.Tensor) -> DTensor:
    """A parameter FSDP2 sharded: a DTensor on its (dp) or (dp, tp) mesh."""
    assert isinstance(p, DTensor)
    return p


def _mesh(group: dist.ProcessGroup | None, device: str) -> DeviceMesh | None:
    return DeviceMesh.from_group(group, device) if group is not None else None


class FsdpReducer:
    """One set of parameters (dense, routers or experts) that FSDP2 shards: the reducer's interface
    (`parallel.runtime.dp.data_parallel.GradientReducer`) over FSDP2's sharded parameters and gradients. FSDP2 reduces
    during backward; the step and the checkpoint work on the shards, which are the parameters themselves."""

    zero = True
    holders = 1
    """Each reduced gradient element is held by one rank of the group: its shard's."""
    started_early = 0

    def __init__(self, chunk_params: list[list[nn.Parameter]], sharded: ShardedChunks, reduce_dtype: str):
        self.params = [p for params in chunk_params for p in params]
        self.sharded = sharded
        itemsize = WIRE_DTYPES[reduce_dtype].itemsize
        # What one backward of each chunk hands to its reduce-scatters: the gradients of the rank's (tp-local)
        # parameters, whole: the shard's elements times the group's size (dim 0 of the parameter's mesh).
        self._chunk_wire = [sum(local_part(p).numel() * _dtensor(p).device_mesh.size(0) for p in params) * itemsize
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
        return [(local_part(p.grad), p) for p in self.params if p.grad is not None]

    @staticmethod
    def tp_copies(p: torch.Tensor, tp: int) -> int:
        """tp ranks holding the same local gradient: 1 if `p` is sharded over the mesh's tp dimension."""
        sharded = _dtensor(p)
        names = sharded.device_mesh.mesh_dim_names or ()
        return 1 if any(n == "tp" and pl.is_shard() for n, pl in zip(names, sharded.placements, strict=True)) else tp

    def optimizer_params(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [(p, p) for p in self.params]

    def moments(self, state: Mapping[torch.Tensor, Mapping[str, torch.Tensor]], keys: tuple[str, ...]
                ) -> dict[nn.Parameter, dict]:
        """Each parameter's state (`data_parallel.OptimizerState`): sharded like the parameter, so DCP saves it under
        the unsharded shape."""
        return {p: {k: state[p][k] for k in keys} for p in self.params}

    def load_moments(self, state: Mapping[torch.Tensor, Mapping[str, torch.Tensor]],
                     moments: dict[nn.Parameter, dict]) -> None:
        """The state's tensors were filled in place: nothing to do."""

    def gather_params(self) -> None:
        """Nothing: the next forward gathers what it needs."""


def next_computes(actions: list[Action], is_compute: Callable[[Action], bool]) -> list[Action | None]:
    """For each action, the next compute action after it in the list (None for the last)."""
    out: list[Action | None] = [None] * len(actions)
    following = None
    for i in range(len(actions) - 1, -1, -1):
        out[i] = following
        if is_compute(actions[i]):
            following = actions[i]
    return out
