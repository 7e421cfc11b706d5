"""A step's micro-batches as one context-parallel rank reads them: its tokens of every sequence (`chunks`), their
positions by global index, and the `ContextShard` its attention rings over (`Documents.context`).

The rank loads the micro-batch's whole rows (the sample ids are its replica's, the same on every cp rank) and keeps
its two chunks of the inputs and targets, so its loss is the sum over its targets at the step's global scale and
the group's losses add up to cp=1's. Packed rows keep each token's position inside its example, and the ring reads
the whole rows' segments, so an example whose boundary falls inside a chunk is masked as at cp=1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from trainyard.parallel.models.components.documents import Documents
from trainyard.parallel.runtime.cp.chunks import local_indices, take
from trainyard.parallel.runtime.cp.ring import ContextShard

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs, targets) of one micro-batch, as the pipeline executor's `batch(mb)` returns them."""


@dataclass(frozen=True)
class ContextSplit:
    """One rank's place in its cp group: what it keeps of each micro-batch."""

    group: dist.ProcessGroup | None
    ranks: list[int]
    cp_rank: int
    seq_len: int
    device: torch.device

    @property
    def indices(self) -> torch.Tensor:
        return local_indices(self.seq_len, self.cp_rank, len(self.ranks))

    def batches(self, batch: Callable[[int], Batch]) -> Callable[[int], Batch]:
        """`batch(mb)` for the executor: this rank's tokens of micro-batch mb's inputs and targets."""
        kept: dict[int, Batch] = {}

        def mine(mb: int) -> Batch:
            if mb not in kept:
                inputs, targets = batch(mb)
                kept[mb] = (take(inputs, self.indices), take(targets, self.indices))
            return kept[mb]

        return mine

    def documents(self, batch: Callable[[int], Batch], packed: Callable[[int], Documents] | None
                  ) -> Callable[[int], Documents]:
        """`documents(mb)` for the executor: this rank's positions and the ring's shard, made once per micro-batch
        (packed rows: positions inside each example and the whole rows' segments)."""
        made: dict[int, Documents] = {}

        def documents(mb: int) -> Documents:
            if mb not in made:
                idx = self.indices.to(self.device)
                rows = batch(mb)[0].shape[0]
                if packed is None:
                    positions, segments, whole = idx.expand(rows, -1), torch.zeros(rows, idx.numel(),
                                                                                    dtype=torch.int64), None
                else:
                    docs = packed(mb)
                    positions, segments, whole = take(docs.positions, idx), take(docs.segments, idx), docs.segments
                shard = ContextShard(self.group, self.ranks, self.cp_rank, self.seq_len,
                                     None if whole is None else whole.to(self.device), self.device)
                made[mb] = Documents(positions.to(self.device), segments.to(self.device), shard)
            return made[mb]

        return documents
