"""Gradient reduction across the ranks that hold the same parameters: bucketed, overlapped with backward,
and optionally sharding the optimizer state (ZeRO-1).

A `GradientReducer` owns one set of parameters and the group that sums their gradients (dense parameters:
the data-parallel group; MoE routers and experts: see `parallel.models.components.moe`). Written by hand instead of
wrapping stages in DistributedDataParallel (or FSDP2's `fully_shard`) because:
- the loss is already normalised by the global token count, so a SUM of gradients is the exact gradient
  of the global batch (DDP averages, which would need the loss rescaled by dp);
- with pipeline schedules a chunk's micro-batch backwards interleave with other micro-batches' forwards,
  and a chunk's gradients are final only at its last backward in the schedule, which the schedule knows
  (`arm`), not autograd; DDP would need `no_sync` around all the others and knows nothing of chunks;
- one reducer serves every set (dense, router, experts), each over its own group, whatever the layout.

Gradients in place, as DDP's `gradient_as_bucket_view`: each parameter's gradient lives in a view into a flat
bucket kept for the whole job, so the reduction runs in place and the optimizer reads it there. Nothing is
zeroed: `zero_grad` sets `.grad` to None, autograd hands the step's first gradient of a parameter over as a
tensor of its own (no add), and the parameter's post-accumulate hook copies it into its view once and makes the
view its `.grad`; later micro-batches add into the view in place. (Zeroing every bucket each step and adding
every first gradient into it was one write and one read more per element.) A parameter that got no gradient
in the step (an expert no token reached) has its view zeroed just before its bucket's reduction starts (and
one whose `.grad` was set by hand is copied in then).
Buckets hold one chunk's parameters in reverse order, the order their gradients become final; each chunk's first
bucket holds at most FIRST_BUCKET_BYTES, the rest BUCKET_BYTES (DDP's two sizes). Without the small first bucket
a chunk under BUCKET_BYTES (the dp bench's 13 MB GPT) was one bucket, whose reduction could start only when
backward's last gradient landed: `overlap_reduce` overlapped nothing, the step equal to one all-reduce after
backward's.

Overlap: `arm(chunk)` before the chunk's last backward turns on its parameters' post-accumulate hooks; a
bucket whose parameters have all accumulated starts its reduction at once (asynchronously), in bucket order
(every rank of the group must issue the same collectives in the same order), so the reduction of the last
layers runs while backward computes the first. `finish()` starts what is left (a parameter that got no
gradient in that backward, e.g. an expert no token reached) and waits for what is in flight.

Shared memory (`parallel.shared_memory_reduce`, on by default): when every rank of the group is a CPU process on one
host, the buckets of a plain `GradientReducer` are views into this rank's row of a tensor the group's ranks all map
(`parallel.runtime.dp.shm_reduce`), and `finish` sums the rows in place instead of calling gloo's all-reduce (TCP
between the processes of one machine). Nothing starts during backward then: the sum is two barriers and one pass over
the memory, cheaper than what overlap hid (dp bench: 0.143 s against 0.149 s a step, the ranks without Ray). ZeRO-1,
bf16 on the wire and PowerSGD keep their collectives.

Sharding is a strategy (`parallel.plan.sharding`, picked by `parallel.zero`), and `make_reducer` builds the
reducer it needs: `GradientReducer` keeps every reduced gradient on every rank (zero 0),
`ShardedGradientReducer` is ZeRO-1, and ZeRO-2/3 are torch's FSDP2 (`parallel.runtime.dp.fsdp.FsdpReducer`: the
pipeline executor tells FSDP2 which chunk to gather and when a chunk's last backward comes, which is what
DDP and plain FSDP usage lack here). Gradient compression (`parallel.grad_compression`) is a compressor
object (`Compressor`, built from the registry `parallel.runtime.compression.COMPRESSORS`) handed to `make_reducer`,
which picks the compressing variant of the strategy's reducer (`parallel.runtime.compression`: powersgd, topk, qsgd).

ZeRO-1 (`ShardedGradientReducer`): each bucket is reduce-scattered instead of all-reduced, so rank i of the group gets
the summed gradients of its 1/N slice of the bucket; the optimizer holds the parameters' pieces in that
slice (views into the parameters, `optimizer_params`), so AdamW's state exists for 1/N of them; after the
step `gather_params` all-gathers the slices and writes every parameter back whole. (FSDP2 has no mode that
shards the optimizer state alone: it always shards the parameters, which is ZeRO-2/3's trade, not ZeRO-1's.)

Tensor-parallel parameters are DTensors: a bucket holds each one's local shard, and its `.grad` is a
DTensor with the parameter's placements over that view. Autograd accumulates a DTensor gradient in place
(`grad += new`), and DTensor first brings `new` to the gradient's placements: a vocabulary-parallel
embedding's gradient (computed whole, DTensor has no row-sharded embedding backward) is sliced to this
rank's rows, and a sequence-parallel norm's gradient (a partial sum over this rank's tokens) is
all-reduced over tp. So every local gradient is complete over tp when its hook fires, and the reduction
sums shards that line up, since the group's ranks hold the same tp coordinate (or all of them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from trainyard.parallel.optim.optimizer import tp_copies
from trainyard.parallel.plan.sharding import Sharding
from trainyard.parallel.runtime.dp.fsdp import FsdpReducer, ShardedChunks
from trainyard.parallel.runtime.dp.grad_buckets import (
    BUCKET_BYTES,
    WIRE_DTYPES,
    Bucket,
    copy_grad,
    grad_of,
    settle,
    shard_of,
    split,
)
from trainyard.parallel.runtime.dp.shm_reduce import shared_rows, sum_rows
from trainyard.parallel.runtime.tp.local_parts import like_param, local_part

OptimizerState = Mapping[torch.Tensor, Mapping[str, torch.Tensor]]  # `StateView.state`, the checkpoint's form


def make_reducer(chunk_params: list[list[nn.Parameter]], group: dist.ProcessGroup | None, sharding: Sharding, *,
                 reduce_dtype: str = "fp32", bucket_bytes: int = BUCKET_BYTES,
                 sharded: ShardedChunks | None = None,
                 compressor: Compressor | None = None, shared_memory: bool = False) -> Reducer:
    """The reducer the sharding strategy needs for this set of parameters. A group of one rank shards
    nothing: every strategy keeps everything there. ZeRO-2/3: the parameters FSDP2 sharded (`sharded`, see
    `parallel.runtime.dp.fsdp`) are reduced by FSDP2. `compressor` (`parallel.grad_compression`): the same reducer with
    its buckets sent compressed (`parallel.runtime.compression`); a group of one rank sends nothing. `shared_memory`: a
    plain reducer whose group's ranks share a host sums through shared memory (module doc)."""
    size = dist.get_world_size(group) if group is not None else 1
    if sharding.shards_parameters and size > 1:
        assert sharded is not None, "ZeRO-2/3 shards the chunks with parallel.runtime.dp.fsdp.shard_chunks first"
        return FsdpReducer(chunk_params, sharded, reduce_dtype)
    cls = ShardedGradientReducer if sharding.shards_optimizer_state and size > 1 else GradientReducer
    if compressor is not None and size > 1:
        return compressor.reducer_class(cls)(chunk_params, group, compressor, reduce_dtype=reduce_dtype,
                                             bucket_bytes=bucket_bytes)
    return cls(chunk_params, group, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes, shared_memory=shared_memory)


class Compressor(Protocol):
    """A gradient compressor, one of `parallel.runtime.compression.COMPRESSORS` (defined here, by the reducer that
    calls it: the compressors' reducers subclass this module's)."""

    step: int
    """The step running now, set by the trainer before each (a warm-up counts the job's steps across resumes)."""

    def reducer_class(self, base: type[GradientReducer]) -> Callable[..., GradientReducer]:
        """The reducer class that sends the buckets of the sharding strategy's reducer `base` compressed, built as
        `cls(chunk_params, group, compressor, reduce_dtype=, bucket_bytes=)` (a `base` it cannot compress: a
        ValueError; the plan refuses such a pair first)."""
        ...


class GradientReducer:
    """The gradients of `params` (parameters of `chunks`), summed over `group` (None: no other rank); every
    rank of the group holds every reduced gradient and the optimizer state of every parameter."""

    zero = False
    """Whether this rank holds only a 1/N slice of the reduced gradients and optimizer state (ZeRO-1)."""
    sums_in_shared_memory = True
    """Whether `shared_memory` may put the buckets in shared rows (`finish` sums them there); a reducer whose
    buckets travel otherwise (reduce-scattered, compressed) keeps its collectives."""

    @torch.no_grad()
    def __init__(self, chunk_params: list[list[nn.Parameter]], group: dist.ProcessGroup | None, *,
                 reduce_dtype: str = "fp32", bucket_bytes: int = BUCKET_BYTES, shared_memory: bool = False):
        self.group, self.reduce_dtype = group, WIRE_DTYPES[reduce_dtype]
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        splits = [(chunk, params) for chunk, params in enumerate(chunk_params)
                  for params in split(list(reversed(params)), bucket_bytes)]
        shared = shared_memory and self.sums_in_shared_memory
        self.rows = self._shared_rows([params for _, params in splits]) if shared else None
        """Shared memory: every rank's buckets, back to back, one row a rank (`parallel.runtime.dp.shm_reduce`)."""
        self._rows_used = 0
        self.buckets = [self._make_bucket(chunk, params) for chunk, params in splits]
        self.next_to_start = 0
        self.armed: set[int] = set()
        self.started_early = 0
        """Buckets whose reduction started during backward in the last step (before `finish`)."""
        for b in self.buckets:
            for i, p in enumerate(b.params):
                p.register_post_accumulate_grad_hook(lambda p, b=b, i=i: self._accumulated(b, i))

    def _padded(self, params: list[nn.Parameter]) -> int:
        """A bucket's length: its parameters', padded so that it splits into equal slices."""
        return -(-sum(local_part(p).numel() for p in params) // self.size) * self.size

    def _shared_rows(self, buckets: list[list[nn.Parameter]]) -> torch.Tensor | None:
        """The rows of shared memory for every bucket, when the group's ranks are CPU processes that can share them
        (every bucket one dtype on the CPU, gradients summed as they are); None, alike on every rank, when not."""
        kinds = {(local_part(p).dtype, local_part(p).device.type) for params in buckets for p in params}
        if self.group is None or self.size == 1 or len(kinds) != 1:
            return None
        [(dtype, device)] = kinds
        if device != "cpu" or dtype != self.reduce_dtype:
            return None
        return shared_rows(self.group, sum(self._padded(params) for params in buckets), dtype)

    def _make_bucket(self, chunk: int, params: list[nn.Parameter]) -> Bucket:
        sizes = [local_part(p).numel() for p in params]
        total = self._padded(params)
        first = local_part(params[0])
        if self.rows is not None:  # this rank's row, where the buckets lie back to back
            flat = self.rows[self.rank, self._rows_used:self._rows_used + total]
            self._rows_used += total
        else:
            flat = torch.zeros(total, dtype=first.dtype, device=first.device)
        offsets, grads, offset = [], [], 0
        for p, n in zip(params, sizes, strict=True):
            p.grad = like_param(p, flat[offset:offset + n].view_as(local_part(p)))
            grads.append(p.grad)
            offsets.append(offset)
            offset += n
        return Bucket(chunk=chunk, params=params, flat=flat, offsets=offsets, grads=grads,
                       landed=len(params))

    @property
    def holders(self) -> int:
        """Ranks of the group that hold each reduced gradient this rank holds after `finish`."""
        return self.size

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank hands to the gradient collectives in a step (a ring all-reduce moves about twice
        that, a reduce-scatter about once); a compressing reducer says what it sent in the last step."""
        return sum(b.flat.numel() for b in self.buckets) * self.reduce_dtype.itemsize if self.group else 0

    def zero_grad(self) -> None:
        """Start a step: no parameter has a gradient (the buckets keep the last step's until each is replaced)."""
        for b in self.buckets:
            for p in b.params:
                p.grad = None
            b.landed = 0

    def arm(self, chunk: int) -> None:
        """The next backward of `chunk` is its last in this step: start each bucket once it is complete (in shared
        memory nothing starts early: `finish` sums every bucket at once)."""
        if self.rows is not None:
            return
        self.armed.add(chunk)
        for b in self.buckets:
            if b.chunk == chunk:
                b.pending = len(b.params)

    def _accumulated(self, bucket: Bucket, i: int) -> None:
        # Runs once per parameter and backward, inside backward (grad mode is off there): kept lean.
        view = bucket.grads[i]
        grad = bucket.params[i].grad
        assert grad is not None  # the hook runs after autograd accumulated the gradient
        if grad is not view:  # the step's first gradient of p, autograd's own tensor: into the bucket, once
            if isinstance(view, DTensor):
                copy_grad(view, grad)
            else:
                view.copy_(grad)
            bucket.params[i].grad = view
            bucket.landed += 1
        if bucket.chunk not in self.armed or bucket.pending == 0:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start_ready()

    def _start_ready(self, everything: bool = False) -> None:
        while self.next_to_start < len(self.buckets):
            b = self.buckets[self.next_to_start]
            if not everything and (b.chunk not in self.armed or b.pending > 0):
                return
            if b.landed < len(b.params):
                settle(b)
            self._start(b)
            self.next_to_start += 1

    @torch.no_grad()
    def _start(self, b: Bucket) -> None:
        if self.group is None or self.rows is not None:
            return
        send = b.flat if self.reduce_dtype == b.flat.dtype else b.flat.to(self.reduce_dtype)
        b.wire = send
        b.work = dist.all_reduce(send, group=self.group, async_op=True)

    def _reduced(self, b: Bucket) -> torch.Tensor:
        """Where a bucket's reduced gradients end up on this rank."""
        return b.flat

    @torch.no_grad()
    def finish(self) -> None:
        """Start every reduction not started yet (in order) and wait for all of them."""
        self.started_early = self.next_to_start if self.group is not None else 0
        self._start_ready(everything=True)
        if self.rows is not None:
            assert self.group is not None  # rows are only ever shared within a group
            sum_rows(self.rows, self.group)
        for b in self.buckets:
            if b.work is not None:
                assert b.wire is not None  # set with the work, in `_start`
                b.work.wait()
                target = self._reduced(b)
                if b.wire is not target:
                    target.copy_(b.wire)
            b.work = b.wire = None
        self.next_to_start, self.armed = 0, set()

    def held_grads(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """The reduced gradients this rank holds after `finish`, each with its parameter."""
        return [(local_part(grad_of(p)), p) for b in self.buckets for p in b.params]

    @staticmethod
    def tp_copies(p: torch.Tensor, tp: int) -> int:
        """tp ranks holding the same local gradient as this rank's of `p` (1 if `p` is sharded over tp)."""
        return tp_copies(p, tp)

    def optimizer_params(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """What the optimizer updates, each with the parameter it belongs to: the parameters themselves."""
        return [(p, p) for b in self.buckets for p in b.params]

    @torch.no_grad()
    def moments(self, state: OptimizerState, keys: tuple[str, ...]) -> dict[nn.Parameter, dict]:
        """Each parameter's optimizer state `keys`, shaped like the parameter (for a checkpoint)."""
        return {p: {k: state[p][k] for k in keys} for b in self.buckets for p in b.params}

    @torch.no_grad()
    def load_moments(self, state: OptimizerState, moments: dict[nn.Parameter, dict]) -> None:
        """After `moments`' tensors were filled from a checkpoint: nothing to do, they are the state itself."""

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the optimizer step: every rank updated every parameter, nothing to gather."""


class ShardedGradientReducer(GradientReducer):
    """ZeRO-1: rank i of the group gets the summed gradients of its 1/N slice of each bucket
    (reduce-scatter), the optimizer updates views of the parameters' pieces in that slice, and the slices
    are all-gathered into whole parameters after the step."""

    zero = True
    sums_in_shared_memory = False

    def _make_bucket(self, chunk: int, params: list[nn.Parameter]) -> Bucket:
        bucket = super()._make_bucket(chunk, params)
        flat, total = bucket.flat, bucket.flat.numel()
        per_rank = total // self.size
        start, end = self.rank * per_rank, (self.rank + 1) * per_rank
        bucket.shard = torch.zeros(per_rank, dtype=flat.dtype, device=flat.device)
        for p, a in zip(params, bucket.offsets, strict=True):
            n = local_part(p).numel()
            lo, hi = max(a, start), min(a + n, end)
            if lo < hi:
                bucket.slices.append((p, lo - a, lo - start, hi - lo))
                piece = local_part(p).detach().view(-1)[lo - a:hi - a]
                piece.grad = bucket.shard[lo - start:hi - start]
                bucket.pieces.append(piece)
        return bucket

    @property
    def holders(self) -> int:
        return 1

    @torch.no_grad()
    def _start(self, b: Bucket) -> None:
        send = b.flat if self.reduce_dtype == b.flat.dtype else b.flat.to(self.reduce_dtype)
        shard = shard_of(b)
        b.wire = shard if send is b.flat else torch.empty_like(shard, dtype=self.reduce_dtype)
        b.work = dist.reduce_scatter_tensor(b.wire, send, group=self.group, async_op=True)

    def _reduced(self, b: Bucket) -> torch.Tensor:
        return shard_of(b)

    def held_grads(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """The pieces of the reduced gradients in this rank's slices."""
        return [(shard_of(b)[s:s + n], p) for b in self.buckets for p, _, s, n in b.slices]

    def optimizer_params(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """Views of the parameters' pieces in this rank's slices, whose `.grad` is the reduced slice."""
        return [(piece, p) for b in self.buckets for piece, (p, *_) in zip(b.pieces, b.slices, strict=True)]

    @torch.no_grad()
    def moments(self, state: OptimizerState, keys: tuple[str, ...]) -> dict[nn.Parameter, dict]:
        """The slices are gathered over the group first: a new tensor per parameter."""
        out: dict[nn.Parameter, dict] = {p: {} for b in self.buckets for p in b.params}
        for b in self.buckets:
            for key in keys:
                flat = torch.zeros_like(b.flat)
                for piece, (_, _, s, n) in zip(b.pieces, b.slices, strict=True):
                    flat[self.rank * shard_of(b).numel() + s:][:n] = state[piece][key]
                dist.all_reduce(flat, group=self.group)  # each slice is non-zero on one rank only
                for p, a in zip(b.params, b.offsets, strict=True):
                    out[p][key] = like_param(p, flat[a:a + local_part(p).numel()].view_as(local_part(p)))
        return out

    @torch.no_grad()
    def load_moments(self, state: OptimizerState, moments: dict[nn.Parameter, dict]) -> None:
        """Keep this rank's slices of the whole moments."""
        for b in self.buckets:
            for piece, (p, a, _, n) in zip(b.pieces, b.slices, strict=True):
                for key, full in moments[p].items():
                    state[piece][key].copy_(local_part(full).reshape(-1)[a:a + n])

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the optimizer step: every rank gets every slice and writes its parameters whole."""
        for b in self.buckets:
            mine = b.flat.new_empty(b.flat.numel() // self.size)
            for p, a, s, n in b.slices:
                mine[s:s + n] = local_part(p).view(-1)[a:a + n]
            everything = torch.empty_like(b.flat)
            dist.all_gather_into_tensor(everything, mine, group=self.group)
            for p, a in zip(b.params, b.offsets, strict=True):
                local = local_part(p)
                local.view(-1).copy_(everything[a:a + local.numel()])


Reducer = GradientReducer | FsdpReducer  # what `make_reducer` builds, whatever the sharding strategy
