"""The skeleton every compressor shares (`powersgd`, and `gathered`'s top-k and QSGD): the compressor object (its
options, the job seed, the step running now, its two reducers) and the reducer's bucket flow around what the
compressor sends for a bucket's matrices.

What is the same for every compressor, and lives here: the first `warmup_steps` steps (and a reducer with no other
rank) take the plain reducer's path; every tensor a compressor does not compress (1-D ones, small matrices) is packed
into one buffer and all-reduced whole in `reduce_dtype` as soon as its bucket is complete, then unpacked in
`finish`; ZeRO-1 keeps its slice of the whole bucket once it is reduced; `wire_bytes` is what the last compressed
step handed to the collectives. What differs, and a compressor defines (`CompressingReducer`'s hooks): which of a
bucket's tensors it compresses and what it keeps for them (`_state`), what it sends of them once the bucket is
complete (`_start_matrices`), and how `finish` brings them back (`_finish_compressed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from trainyard.parallel.config import GradCompressionConfig
from trainyard.parallel.runtime.dp.data_parallel import GradientReducer, ShardedGradientReducer
from trainyard.parallel.runtime.dp.grad_buckets import Bucket


@dataclass
class BaseCompressor:
    """A compressor (a `Compressor`): its options, the job seed and the step running now (set by the trainer before
    each step, so warm-up follows the job's step count across resumes). A subclass names its two reducers, plain
    and ZeRO-1."""

    config: GradCompressionConfig
    seed: int
    step: int = 0
    reducers: ClassVar[tuple[type[CompressingReducer], type[CompressingReducer]]]
    """Set by each subclass: its reducer and its ZeRO-1 reducer."""

    @property
    def active(self) -> bool:
        return self.step >= self.config.warmup_steps

    def reducer_class(self, base: type[GradientReducer]) -> type[CompressingReducer]:
        """The compressing variant of a sharding strategy's reducer (`parallel.plan.rules` refuses the others)."""
        plain, sharded = self.reducers
        variants = {GradientReducer: plain, ShardedGradientReducer: sharded}
        if base not in variants:
            raise ValueError(f"{self.config.kind} does not compose with {base.__name__} (it needs whole gradients)")
        return variants[base]


@dataclass(kw_only=True)
class BucketState:
    """What a compressing reducer keeps for one bucket; a compressor's subclass adds its matrices and their wires."""

    rest: list[tuple[int, int]]
    """(offset, length) in the bucket of each tensor sent whole."""
    works: list[dist.Work] = field(default_factory=list)
    rest_wire: torch.Tensor | None = None


StateT = TypeVar("StateT", bound=BucketState)


class CompressingReducer(GradientReducer, Generic[StateT]):
    """The plain reducer with each bucket's compressible tensors sent as the compressor's hooks say (module doc)."""

    sums_in_shared_memory = False

    def __init__(self, chunk_params: list[list[nn.Parameter]], group: dist.ProcessGroup | None,
                 compressor: BaseCompressor, **kwargs):
        self.compressor = compressor
        self._states: dict[int, StateT] = {}
        self._sent: int | None = None
        """Bytes sent in the last step, when it was compressed."""
        super().__init__(chunk_params, group, **kwargs)
        self._index = {id(b): i for i, b in enumerate(self.buckets)}

    # the compressor's hooks

    def _state(self, index: int, b: Bucket) -> StateT:
        """Bucket `index`'s state, made on its first compressed step: which tensors go compressed, which whole."""
        raise NotImplementedError

    def _start_matrices(self, index: int, b: Bucket, st: StateT) -> None:
        """Start sending the compressed tensors of a complete bucket (appending to `st.works`)."""
        raise NotImplementedError

    def _finish_compressed(self) -> int:
        """Wait for every bucket (in order), decode it into the bucket, keep the reduced part; the bytes sent."""
        raise NotImplementedError

    # the flow

    @property
    def wire_bytes(self) -> int:
        return super().wire_bytes if self._sent is None else self._sent

    @property
    def compressing(self) -> bool:
        return self.group is not None and self.compressor.active

    @torch.no_grad()
    def _start(self, b: Bucket) -> None:
        if not self.compressing:
            super()._start(b)
            return
        index = self._index[id(b)]
        st = self._state(index, b)
        if st.rest:
            rest = torch.cat([b.flat[o:o + n] for o, n in st.rest])
            st.rest_wire = rest if rest.dtype == self.reduce_dtype else rest.to(self.reduce_dtype)
            st.works.append(dist.all_reduce(st.rest_wire, group=self.group, async_op=True))
        self._start_matrices(index, b, st)

    @torch.no_grad()
    def finish(self) -> None:
        if not self.compressing:
            self._sent = None
            super().finish()
            return
        self.started_early = self.next_to_start
        self._start_ready(everything=True)
        self._sent = self._finish_compressed()
        self.next_to_start, self.armed = 0, set()

    def _wait(self, b: Bucket, st: StateT) -> int:
        """Wait for a bucket's collectives in flight and unpack its whole tensors; the bytes those sent."""
        for work in st.works:
            work.wait()
        st.works = []
        if st.rest_wire is None:
            return 0
        offset = 0
        for o, n in st.rest:
            b.flat[o:o + n].copy_(st.rest_wire[offset:offset + n])
            offset += n
        return st.rest_wire.numel() * st.rest_wire.element_size()

    def _keep_reduced(self, b: Bucket) -> None:
        """The reduced gradients are in the whole bucket; a sharded reducer keeps its slice as well."""
        target = self._reduced(b)
        if target is not b.flat:
            target.copy_(b.flat[self.rank * target.numel():][:target.numel()])
