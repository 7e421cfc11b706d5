"""What a step of `parallel.runtime.trainer` reads besides its model: the micro-batches (loaded lazily, once, where a
stage needs them), packed data's documents (positions and segments, on the device), the loss's scale (1 / the
targets that count, which every rank works out from the sample ids alone) and the autocast context."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from trainyard.parallel.data.datasets import Dataset, counted_targets, has_loss_mask, load_batch, step_counted_targets
from trainyard.parallel.data.packing import PackedDataset
from trainyard.parallel.data.sampler import step_batch_ids
from trainyard.parallel.models.components.documents import Documents
from trainyard.parallel.plan import Plan
from trainyard.parallel.runtime.pipeline.pipeline import Batch


def autocast_context(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """bf16: matmuls in bf16 under autocast (CUDA and CPU); parameters, gradients, optimizer state and the
    loss stay fp32."""
    if precision == "bf16":
        return functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def loss_scale(plan: Plan, dp_rank: int, dataset: Dataset, local_sync: bool, step: int,
               microbatch_ids: list[list[int]]) -> float:
    """1 / the step's global count of targets that count (at least 1: a batch of masked targets only
    has loss 0). local_sync (local_sgd, diloco, parameter_server): of this replica's share, whose mean gradient it
    steps on alone (or pushes to the server)."""
    cfg = plan.config
    if local_sync:
        replicas = plan.dp // plan.reduce_dp
        if not has_loss_mask(dataset):
            return replicas / (cfg.global_batch * cfg.model.seq_len)
        if plan.reduce_dp == 1:
            return 1.0 / max(1, counted_targets(dataset, [i for ids in microbatch_ids for i in ids]))
        # the replica's share: its dp ranks' contiguous slices of the global batch (`rank_share`)
        ids, share = step_batch_ids(cfg, step, dataset.num_samples), cfg.global_batch // replicas
        replica = dp_rank // plan.reduce_dp
        return 1.0 / max(1, counted_targets(dataset, ids[replica * share:(replica + 1) * share]))
    if not has_loss_mask(dataset):
        return 1.0 / (cfg.global_batch * cfg.model.seq_len)
    return 1.0 / max(1, step_counted_targets(cfg, dataset, step))


def lazy_batches(dataset: Dataset, microbatch_ids: list[list[int]]) -> Callable[[int], Batch]:
    """`batch(mb)` for the executor: micro-batches are read lazily, once, and only where a stage needs them."""
    loaded: dict[int, Batch] = {}

    def batch(mb: int) -> Batch:
        if mb not in loaded:
            loaded[mb] = load_batch(dataset, microbatch_ids[mb])
        return loaded[mb]

    return batch


def lazy_documents(dataset: Dataset, microbatch_ids: list[list[int]], device: torch.device
                    ) -> Callable[[int], Documents] | None:
    """`documents(mb)` for the executor with packed data (None without): every stage's attention reads them, each
    micro-batch's made once, on the device, so its mask is built once per step."""
    if not isinstance(dataset, PackedDataset):
        return None
    made: dict[int, Documents] = {}

    def documents(mb: int) -> Documents:
        if mb not in made:
            made[mb] = dataset.documents(microbatch_ids[mb]).to(device)
        return made[mb]

    return documents
