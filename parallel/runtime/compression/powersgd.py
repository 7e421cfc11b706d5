"""PowerSGD gradient compression (Vogels et al. 2019) on the data-parallel reduction, with error feedback.

`parallel.grad_compression: {kind: powersgd, rank: R, warmup_steps: N}` picks `PowerSGD` from the registry
(`parallel.runtime.compression.COMPRESSORS`), whose `reducer_class` makes `make_reducer` build a `PowerSGDReducer`
(or, with ZeRO-1, `ShardedPowerSGDReducer`) instead of the plain one. Per bucket, once its
gradients are final (during backward, as the plain reduction starts), every gradient matrix M (a parameter's
local 2-D gradient, this rank's shard of a DTensor's: the group's ranks hold the same tp coordinate, so the
shards line up) large enough to gain (rows x cols > min_compression_rate x (rows + cols) x r, torch's rule:
`parallel.plan.grad_compression.approximation_rank`) is sent as two thin factors:

    M <- M + e (the error this rank kept last step);  P = M Q;  all-reduce P;  P^ = orthonormalise(P)
    Q_i = M^T P^ (this rank's);  e <- M - P^ Q_i^T;  all-reduce Q = sum_i Q_i;  M' = P^ Q^T

so M' = P^ P^T (sum_i M_i): every rank gets the same rank-r approximation of the SUMMED gradient (our loss is
normalised by the global token count, so the reduction sums; see `parallel.runtime.dp.data_parallel`). Each rank's
error is what its own gradient lost in the projection (the paper's local error memory, as the authors'
epfml/powersgd reducer computes it: before Q is reduced), so the errors of a step add up to exactly
(sum_i M_i) - M' and are sent later (torch's hook keeps M_i - M'/N, which adds up to the same). At full
rank, r = min(rows, cols) (r is min(rank, rows, cols)), P^ spans the sum's columns and M' is the exact sum;
a rank's own error need not be zero then (its columns may leave that span), but the errors cancel.
Every other tensor (1-D ones, small matrices) is packed into one buffer and all-reduced whole, in
`reduce_dtype`. The first `warmup_steps` steps reduce everything uncompressed (the plain reducer's path)
and keep no error.

Q is warm-started (kept from the last step, as torch's default `warm_start`), and first drawn from a
generator seeded by (job seed, bucket, parameter): every rank of a group draws the same Q without talking.
P^ is the Q factor of a QR decomposition of the all-reduced P, the same on every rank.

Why not torch's `ddp_comm_hooks.powerSGD_hook`: it is a DDP communication hook, taking DDP's C++ GradBucket
and averaging over the group; our reducer is written by hand (see `parallel.runtime.dp.data_parallel`), sums, keeps
DTensor shards and ZeRO-1 slices in its buckets. The algorithm and its choices (the min_compression_rate
rule, warm start, QR, warm-up) follow that hook, and its numbers are the hook's: tests/integration/
test_grads_gloo.py runs the hook itself on the same gradients from the same Q (ours = its result x world
size, within 6e-7 over compressed steps with error feedback). Under AdamW a low rank costs loss that no
warm-up short of most of the run recovers (BENCHMARKS.md, section savers_grads: rank 4 on the demo job at 400
steps); by hand, freezing Adam's second moment did not help, nor did 16 power iterations a step instead of one
(`bench.powersgd_iterations`, which writes no row).

Timing: phase 1 (P, with the uncompressed rest) starts as soon as the bucket is complete, overlapped with
backward; phase 2 (orthonormalise, Q) runs in `finish`, bucket by bucket in order (every rank issues the same
collectives in the same order), Q reductions in flight together.

ZeRO-1: the decompressed sum lands in the whole bucket, and this rank keeps its slice as its reduced shard.
ZeRO-2/3 keep only a shard of each gradient, while PowerSGD needs whole matrices and a whole-size error per
rank: `parallel.plan.rules` refuses the pair.

Checkpoints: the error feedback and Q are not saved. After a resume (or a recovery, or a resize) they start
again: the errors at zero, Q drawn again from the seed; the step counter is the trainer's, so warm-up is not
repeated. Training goes on exactly from the saved parameters and optimizer state; only the residual of the
last step before the save (one step's compression error) is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from trainyard.parallel.plan.grad_compression import approximation_rank
from trainyard.parallel.runtime.compression.base import BaseCompressor, BucketState, CompressingReducer
from trainyard.parallel.runtime.dp.data_parallel import ShardedGradientReducer
from trainyard.parallel.runtime.dp.grad_buckets import Bucket as _Bucket
from trainyard.parallel.runtime.tp.local_parts import local_part
from trainyard.parallel.seeds import derive_seed


def matrix_shape(shape: torch.Size) -> tuple[int, int] | None:
    """A gradient as a matrix: 2-D as it is, more dimensions flattened after the first; 1-D: None."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    return rows, int(torch.Size(shape).numel() // rows)


@dataclass
class _Matrix:
    offset: int
    rows: int
    cols: int
    q: torch.Tensor
    """cols x r: warm-started from the last step's summed Q."""
    error: torch.Tensor
    """rows x cols: what this rank's gradient lost to the approximation last step."""
    p: torch.Tensor | None = None


@dataclass(kw_only=True)
class _BucketState(BucketState):
    matrices: list[_Matrix]
    p_wire: torch.Tensor | None = None
    q_wire: torch.Tensor | None = None


class PowerSGDReducer(CompressingReducer[_BucketState]):
    """The plain reducer with each bucket's large gradient matrices sent as PowerSGD factors (module doc)."""

    compressor: PowerSGD

    def _state(self, index: int, b: _Bucket) -> _BucketState:
        if index not in self._states:
            matrices, rest = [], []
            for i, (p, offset) in enumerate(zip(b.params, b.offsets, strict=True)):
                local = local_part(p)
                shape = matrix_shape(local.shape)
                r = approximation_rank(*shape, self.compressor.config) if shape is not None else None
                if shape is None or r is None:
                    rest.append((offset, local.numel()))
                    continue
                rows, cols = shape
                q = self.compressor.initial_q((index, i), cols, r, b.flat)
                matrices.append(_Matrix(offset, rows, cols, q, torch.zeros(rows, cols, dtype=b.flat.dtype,
                                                                           device=b.flat.device)))
            self._states[index] = _BucketState(matrices=matrices, rest=rest)
        return self._states[index]

    def _matrix(self, b: _Bucket, m: _Matrix) -> torch.Tensor:
        return b.flat[m.offset:m.offset + m.rows * m.cols].view(m.rows, m.cols)

    def _start_matrices(self, index: int, b: _Bucket, st: _BucketState) -> None:
        if st.matrices:
            ps = []
            for m in st.matrices:
                M = self._matrix(b, m)
                M.add_(m.error)
                m.p = M @ m.q
                ps.append(m.p.reshape(-1))
            st.p_wire = torch.cat(ps)
            st.works.append(dist.all_reduce(st.p_wire, group=self.group, async_op=True))

    def _finish_compressed(self) -> int:
        sent = 0
        for index, b in enumerate(self.buckets):  # phase 2: orthonormalise P, send Q
            st = self._states[index]
            sent += self._wait(b, st)
            if not st.matrices:
                continue
            p_wire = st.p_wire
            assert p_wire is not None  # `_start_matrices` sent the matrices' P
            sent += p_wire.numel() * p_wire.element_size()
            offset, qs = 0, []
            for m in st.matrices:
                assert m.p is not None  # set with p_wire
                n = m.p.numel()
                m.p = torch.linalg.qr(p_wire[offset:offset + n].view_as(m.p)).Q
                offset += n
                M = self._matrix(b, m)
                q_local = M.T @ m.p
                m.error.copy_(M - m.p @ q_local.T)
                qs.append(q_local.reshape(-1))
            st.q_wire = torch.cat(qs)
            st.works.append(dist.all_reduce(st.q_wire, group=self.group, async_op=True))
        for index, b in enumerate(self.buckets):  # decompress: M' = P^ Q^T
            st = self._states[index]
            if st.q_wire is not None:
                st.works.pop().wait()
                sent += st.q_wire.numel() * st.q_wire.element_size()
                offset = 0
                for m in st.matrices:
                    m.q = st.q_wire[offset:offset + m.q.numel()].view_as(m.q).clone()
                    offset += m.q.numel()
                    assert m.p is not None  # orthonormalised in phase 2
                    self._matrix(b, m).copy_(m.p @ m.q.T)
                    m.p = None
                st.q_wire = st.p_wire = None
            st.rest_wire = None
            self._keep_reduced(b)
        return sent


class ShardedPowerSGDReducer(PowerSGDReducer, ShardedGradientReducer):
    """ZeRO-1 with PowerSGD: the compressed all-reduce fills the whole bucket, this rank keeps its slice."""


class PowerSGD(BaseCompressor):
    """The compressor the trainer's reducers share (a `Compressor`, `parallel.runtime.compression.base`)."""

    reducers = (PowerSGDReducer, ShardedPowerSGDReducer)

    def initial_q(self, key: tuple, cols: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "powersgd", *key))
        return torch.randn(cols, rank, generator=gen).to(dtype=torch.float32, device=like.device)
