"""Whole examples (`data.packing` set) and the epochs over them (`data.epochs`).

An example is a document of a `trainyard prepare` directory: its tokens and the EOS after them, whose ends
`documents.bin` records. An example of L tokens gives L - 1 (input, target) pairs; one longer than seq_len + 1
tokens is cut into consecutive pieces of at most seq_len + 1 tokens that overlap by one token, so each of its
targets is in exactly one piece (a piece attends only within itself: the cut is where context is lost).

- `packing: false`: each piece is one sequence, padded after its end; the padding's targets are IGNORE and,
  with causal attention, no real token attends to the padding, so the model needs nothing else.

Epochs: a sample id is a sequence's index. Step s's global batch is positions [s*G, (s+1)*G) of the endless
run of epochs, each epoch a permutation of every sequence drawn from (seed, epoch): every sequence is seen once
per epoch, and the ids are a function of (seed, step) alone, so every layout (and a resume mid-epoch at another
layout, or after a resize) trains on the same samples in the same steps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from trainyard.parallel.data.token_dir import Manifest, Segments
from trainyard.parallel.seeds import derive_seed

if TYPE_CHECKING:
    import torch


def pieces(ends: np.ndarray, seq_len: int, begin: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """(starts, stops, examples cut) of the pieces of the consecutive documents that start at `begin` and end at
    `ends`: each at most seq_len + 1 tokens, consecutive pieces of one document overlapping by one token. A
    one-token document has no target and no piece."""
    starts_doc = np.concatenate([[begin], ends[:-1]]).astype(np.int64)
    targets = ends - starts_doc - 1
    counts = np.where(targets > 0, -(-targets // seq_len), 0)
    first = np.repeat(starts_doc, counts)
    k = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = first + k * seq_len
    stops = np.minimum(starts + seq_len + 1, np.repeat(ends, counts))
    return starts, stops, int((counts > 1).sum())


@dataclass
class ExampleDataset:
    """The padded pieces of a prepared directory's examples (`packing: false`), read as samples of seq_len + 1
    tokens with a target mask (as `TokenDataset`'s), so batches load and count the same way."""

    tokens: Segments | np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    seq_len: int
    vocab_size: int
    source: str
    pad_id: int
    mask: Segments | np.ndarray | None = None
    field: str = "data.path"
    manifest: Manifest | None = None
    cut_examples: int = 0
    """Examples longer than seq_len + 1 tokens, cut into pieces."""

    @property
    def num_samples(self) -> int:
        return len(self.starts)

    def sample(self, i: int) -> torch.Tensor:
        """The piece's tokens, then padding. (Every id is below vocab_size: the directory's manifest says its
        vocabulary, checked against the model's when it is opened.)"""
        import torch

        a, b = int(self.starts[i]), int(self.stops[i])
        window = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        window[: b - a] = self.tokens[a:b]
        return torch.from_numpy(window)

    def target_mask(self, i: int) -> torch.Tensor:
        """The piece's targets count (the mask's, for chat data); the padding's do not."""
        import torch

        a, b = int(self.starts[i]), int(self.stops[i])
        counted = np.zeros(self.seq_len, dtype=np.bool_)
        counted[: b - a - 1] = True if self.mask is None else np.asarray(self.mask[a + 1:b], dtype=np.bool_)
        return torch.from_numpy(counted)


def epochs_steps(epochs: int, sequences: int, global_batch: int) -> int:
    """Steps that cover `epochs` passes over `sequences` (the last step may run into the next epoch)."""
    return math.ceil(epochs * sequences / global_batch)


def epoch_of(step: int, global_batch: int, sequences: int) -> float:
    """Epochs done at the end of `step` (0-based): 1.0 at the step that finishes the first pass."""
    return (step + 1) * global_batch / sequences


@functools.lru_cache(maxsize=4)
def _order(seed: int, epoch: int, sequences: int) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(derive_seed(seed, "epoch", epoch))
    return torch.randperm(sequences, generator=gen).tolist()


def epoch_batch_ids(seed: int, step: int, global_batch: int, sequences: int) -> list[int]:
    """Sample ids of step `step`'s global batch: positions [step*G, (step+1)*G) of the epochs' orders."""
    ids = []
    for position in range(step * global_batch, (step + 1) * global_batch):
        epoch, k = divmod(position, sequences)
        ids.append(_order(seed, epoch, sequences)[k])
    return ids
