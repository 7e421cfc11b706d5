"""Top-k gradient sparsification (Aji & Heafield 2017, "Sparse Communication for Distributed Gradient Descent")
on the data-parallel reduction, with error feedback.

`parallel.grad_compression: {kind: topk, ratio: 0.01, error_feedback: true}` picks `TopK` from the registry
(`parallel.runtime.compression.COMPRESSORS`). Per bucket, once its gradients are final, each gradient matrix
(`parallel.runtime.compression.gathered`: a parameter's local gradient of two or more dimensions) of n elements
sends its k = ceil(ratio x n) largest elements by magnitude (`parallel.plan.grad_compression.topk_count`):

    a <- g + e (the residual this rank kept last step);  I = the k indices of a's largest |a_i|
    send (I, a_I) as k int32 indices and k fp32 values;  e <- a with a_I set to 0

so what a rank sends plus what it keeps is exactly a (`select`). The pairs are all-gathered and every rank
scatter-adds every rank's values into zeros, rank 0 first: the reduced matrix is sum_r (a_r restricted to I_r),
the same on every rank (the reduction sums, as the plain one does). Each rank's residual carries what it dropped
into its next step (Aji & Heafield's "we keep the remaining gradients as residuals"), so nothing is lost, only
late; with `error_feedback: false` it is dropped. At ratio 1 every element is sent and the residual is zero: the
sum is the plain reduction's, exactly at dp=2 (one addition per element either way). The paper drops by one
threshold over all parameters; here each matrix keeps its own k (as Deep Gradient Compression does per layer), so
every rank's payload has one fixed size, which an all-gather needs.

Checkpoints do not hold the residuals: after a resume (or a recovery, a resize) they start again at zero, and only
the last step's residual (what it had not sent yet) is lost, as with PowerSGD's error feedback.
"""

from __future__ import annotations

import torch
from trainyard.parallel.plan.grad_compression import topk_count
from trainyard.parallel.runtime.compression.gathered import GatheringCompressor, GatheringReducer
from trainyard.parallel.runtime.dp.data_parallel import ShardedGradientReducer


def select(acc: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices, values, residual) of a 1-D fp32 `acc`: the k indices of its largest magnitudes (int64), their
    values, and `acc` with them set to zero (a new tensor); values scattered into zeros plus the residual is acc,
    exactly."""
    indices = acc.abs().topk(k, sorted=False).indices
    residual = acc.clone()
    residual[indices] = 0
    return indices, acc[indices], residual


class TopKReducer(GatheringReducer):
    """The plain reducer with each bucket's gradient matrices sent as their top-k (index, value) pairs."""

    wire_dtype = torch.int32

    def __init__(self, *args, **kwargs):
        self.residuals: dict[tuple[int, int], torch.Tensor] = {}
        """(bucket, matrix) -> what this rank did not send of it yet (fp32, 1-D), with error feedback."""
        super().__init__(*args, **kwargs)

    def wire_length(self, elements: int) -> int:
        return 2 * topk_count(elements, self.compressor.config.ratio)

    def encode(self, key: tuple[int, int], grad: torch.Tensor) -> torch.Tensor:
        cfg = self.compressor.config
        acc = grad.float()
        if cfg.error_feedback and key in self.residuals:
            acc = acc + self.residuals[key]
        indices, values, residual = select(acc, topk_count(acc.numel(), cfg.ratio))
        if cfg.error_feedback:
            self.residuals[key] = residual
        return torch.cat([indices.to(torch.int32), values.view(torch.int32)])

    def add_decoded(self, total: torch.Tensor, codes: torch.Tensor) -> None:
        k = codes.numel() // 2
        total.index_add_(0, codes[:k].long(), codes[k:].view(torch.float32))


class ShardedTopKReducer(TopKReducer, ShardedGradientReducer):
    """ZeRO-1 with top-k: the decoded sum fills the whole bucket, this rank keeps its slice."""


class TopK(GatheringCompressor):
    """The top-k compressor the trainer's reducers share (a `Compressor`)."""

    reducers = (TopKReducer, ShardedTopKReducer)
