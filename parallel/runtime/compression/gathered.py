"""The reducer shared by the compressors whose rank-local codes cannot be summed on the wire (top-k, QSGD): each
rank encodes each gradient matrix of a bucket, the codes are all-gathered, and every rank decodes every rank's
codes and sums them, in rank order, into the bucket.

A sum of sparse (index, value) lists or of quantized codes is not a sparse list or a code of the same length, so
an all-reduce cannot add them on the way (PowerSGD's factors are dense and linear: it all-reduces them); the
all-gather moves each rank's payload to every other rank, and the sum happens after it. Every rank adds the same
decoded tensors in the same order (rank 0 first), so the reduced gradients are bitwise alike on every rank. The
reduction sums, as the plain one does (the loss is normalised by the global token count:
`parallel.runtime.dp.data_parallel`).

What a compressor defines (`GatheringReducer`'s hooks): `wire_dtype`, the length of one matrix's codes
(`wire_length`), `encode` (a matrix's gradient, as a 1-D view of the bucket -> its codes; a compressor with error
feedback updates what it keeps there) and `add_decoded` (one rank's codes of a matrix added into the sum). A
matrix is a parameter's local gradient of two or more dimensions (this rank's shard of a DTensor's: the group's
ranks hold the same tp coordinate, so the shards line up); every 1-D tensor is packed into one buffer and
all-reduced whole in `reduce_dtype`, as with PowerSGD (a norm's or a bias's few elements gain nothing). The
first `warmup_steps` steps take the plain reducer's path (that flow, shared with PowerSGD, is
`parallel.runtime.compression.base`'s).

Timing: a bucket's codes are encoded and their all-gather started as soon as its gradients are final (during
backward, as the plain reduction starts); `finish` waits for each bucket in order and decodes it. ZeRO-1: the
decoded sum lands in the whole bucket and this rank keeps its slice. ZeRO-2/3 keep only a shard of each gradient:
`parallel.plan.rules` refuses the pair (`CompressionKind.whole_gradients`).

`wire_bytes` (the step's `reduce_bytes`) is the payload this rank hands to the collectives: its own codes and the
packed 1-D tensors (an all-gather then delivers the group's N - 1 other payloads to each rank), as
`parallel.plan.reduction_bytes` counts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from trainyard.parallel.runtime.compression.base import BaseCompressor, BucketState, CompressingReducer
from trainyard.parallel.runtime.dp.grad_buckets import Bucket
from trainyard.parallel.runtime.tp.local_parts import local_part


class GatheringCompressor(BaseCompressor):
    """A gathering compressor (a `Compressor`, `parallel.runtime.compression.base`): its reducers gather codes."""

    reducers: ClassVar[tuple[type[GatheringReducer], type[GatheringReducer]]]


@dataclass(kw_only=True)
class _BucketState(BucketState):
    matrices: list[tuple[int, int]]
    """(offset, elements) in the bucket of each gradient matrix, encoded."""
    send: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    """[rank] every rank's codes of the bucket's matrices, back to back."""


class GatheringReducer(CompressingReducer[_BucketState]):
    """The plain reducer with each bucket's gradient matrices encoded, all-gathered, decoded and summed (module
    doc); a compressor subclasses it with its hooks."""

    wire_dtype: torch.dtype = torch.uint8
    """The type of the codes on the wire."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0

    # the compressor's hooks

    def wire_length(self, elements: int) -> int:
        """Elements of `wire_dtype` a matrix of `elements` sends."""
        raise NotImplementedError

    def encode(self, key: tuple[int, int], grad: torch.Tensor) -> torch.Tensor:
        """Matrix `key` (bucket, matrix)'s gradient, a 1-D view of its bucket -> its codes (`wire_length`)."""
        raise NotImplementedError

    def add_decoded(self, total: torch.Tensor, codes: torch.Tensor) -> None:
        """Add one rank's `codes` of a matrix into `total` (fp32, 1-D, the matrix's elements)."""
        raise NotImplementedError

    # the flow (`CompressingReducer`'s hooks)

    def _state(self, index: int, b: Bucket) -> _BucketState:
        if index not in self._states:
            matrices: list[tuple[int, int]] = []
            rest: list[tuple[int, int]] = []
            for p, offset in zip(b.params, b.offsets, strict=True):
                local = local_part(p)
                (matrices if local.dim() >= 2 else rest).append((offset, local.numel()))
            self._states[index] = _BucketState(matrices=matrices, rest=rest)
        return self._states[index]

    def _start_matrices(self, index: int, b: Bucket, st: _BucketState) -> None:
        if st.matrices:
            st.send = torch.cat([self.encode((index, i), b.flat[o:o + n]) for i, (o, n) in enumerate(st.matrices)])
            st.gathered = st.send.new_empty(self.size * st.send.numel())  # flat: gloo takes no stacked output
            st.works.append(dist.all_gather_into_tensor(st.gathered, st.send, group=self.group, async_op=True))

    def _finish_compressed(self) -> int:
        sent = 0
        for index, b in enumerate(self.buckets):
            st = self._states[index]
            sent += self._wait(b, st)
            if st.send is not None:
                assert st.gathered is not None  # gathered with the send, in `_start_matrices`
                sent += st.send.numel() * st.send.element_size()
                self._decode(b, st, st.gathered.view(self.size, -1))
            st.send = st.gathered = st.rest_wire = None
            self._keep_reduced(b)  # ZeRO-1: this rank's slice of the whole bucket
        return sent

    def _decode(self, b: Bucket, st: _BucketState, gathered: torch.Tensor) -> None:
        """Every rank's codes of each matrix, decoded and summed in rank order into the bucket."""
        offset = 0
        for o, n in st.matrices:
            length = self.wire_length(n)
            target = b.flat[o:o + n]
            total = target.zero_() if target.dtype == torch.float32 else torch.zeros(n, device=target.device)
            for rank in range(self.size):
                self.add_decoded(total, gathered[rank, offset:offset + length])
            if total is not target:
                target.copy_(total)
            offset += length
