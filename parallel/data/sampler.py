"""The layout-independent sampler: the sample ids of step s's global batch from (seed, step) alone (windows drawn
at random, or whole examples epoch by epoch), a data-parallel rank's share of them, and the validation batches.
So every layout trains on the same sequences in the same steps, and a worker reads only the samples it is given
(`parallel.data.datasets` reads them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainyard.parallel.config import JobConfig
from trainyard.parallel.data.examples import epoch_batch_ids
from trainyard.parallel.seeds import derive_seed

if TYPE_CHECKING:
    from trainyard.parallel.plan import Plan


def validation_batches(config: JobConfig, num_samples: int) -> list[list[int]]:
    """The sample ids of each validation batch (`eval.batches` of global_batch sequences): spread evenly over
    the validation data and the same at every evaluation, so val_loss is comparable across steps."""
    count = config.eval.batches * config.global_batch
    ids = [i * num_samples // count for i in range(count)] if num_samples >= count else \
        [i % num_samples for i in range(count)]
    return [ids[b * config.global_batch:(b + 1) * config.global_batch] for b in range(config.eval.batches)]


def global_batch_ids(seed: int, step: int, global_batch: int, num_samples: int) -> list[int]:
    """Sample ids of step `step`'s global batch: a function of (seed, step) only."""
    import torch

    gen = torch.Generator().manual_seed(derive_seed(seed, "batch", step))
    return torch.randint(num_samples, (global_batch,), generator=gen).tolist()


def step_batch_ids(config: JobConfig, step: int, num_samples: int) -> list[int]:
    """Sample ids of step `step`'s global batch: windows drawn at random, or whole examples epoch by epoch."""
    if config.data.packing is None:
        return global_batch_ids(config.seed, step, config.global_batch, num_samples)
    return epoch_batch_ids(config.seed, step, config.global_batch, num_samples)


def step_microbatches(plan: Plan, rank: int, step: int, num_samples: int) -> list[list[int]]:
    """The sample ids of `rank`'s micro-batches in step `step`: its data-parallel share of the global batch
    (what the coordinator sends the rank; it computes the global batch once for all ranks)."""
    cfg = plan.config
    ids = step_batch_ids(cfg, step, num_samples)
    return rank_share(ids, plan.coords(rank).dp, plan.dp, plan.microbatches)


def rank_share(ids: list[int], dp_rank: int, dp: int, microbatches: int) -> list[list[int]]:
    """The micro-batches of data-parallel rank `dp_rank`: a contiguous slice of the global batch, split evenly."""
    per_rank = len(ids) // dp
    mine = ids[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    size = per_rank // microbatches
    return [mine[i * size : (i + 1) * size] for i in range(microbatches)]
