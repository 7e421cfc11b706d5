"""Whole examples packed into sequences (`data.packing: true`).

The pieces of the examples (`parallel.data.examples.pieces`: each at most seq_len + 1 tokens, so at most
seq_len targets) are packed in stream order, greedily: a row takes the next pieces while their targets (a
piece's length - 1) fit seq_len. A row's inputs are its pieces' tokens but the last, its targets their tokens
but the first (each piece shifted on its own, so no target is the next example's first token), then padding
whose targets do not count. Each token also carries its position in its piece (restarting at 0) and its segment
(the piece's index in the row; the padding one segment after the last piece), which the model turns into a
block-diagonal causal mask and per-example positions (`parallel.models.components.documents`).

Rows are the samples: a sample id is a row's index, so epochs, counted targets and the layout-independence of
the batches are those of `packing: false` (`parallel.data.examples`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from trainyard.parallel.data.examples import ExampleDataset

if TYPE_CHECKING:
    import torch
    from trainyard.parallel.models.components.documents import Documents


def pack(targets: np.ndarray, seq_len: int) -> np.ndarray:
    """Row bounds of pieces with these target counts (each 1..seq_len): row r holds pieces [bounds[r],
    bounds[r + 1]), consecutive, the most that fit seq_len targets."""
    bounds, used = [0], 0
    for k, n in enumerate(targets.tolist()):
        if used + n > seq_len:
            bounds.append(k)
            used = 0
        used += n
    bounds.append(len(targets))
    return np.asarray(bounds, dtype=np.int64)


@dataclass
class PackedDataset(ExampleDataset):
    """The pieces of a prepared directory's examples packed into rows of seq_len targets (see the module
    docstring). A row's inputs and targets are not one shifted window, so it has no `sample`: `load_batch` reads
    `pair`."""

    rows: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.rows = pack(self.stops - self.starts - 1, self.seq_len)

    @property
    def num_samples(self) -> int:
        return len(self.rows) - 1

    def sample(self, i: int) -> torch.Tensor:
        raise TypeError("a packed row's inputs and targets are not one window of seq_len + 1 tokens: read it with "
                        "load_batch (PackedDataset.pair)")

    def _pieces(self, i: int) -> list[tuple[int, int]]:
        """(start, stop) of row i's pieces."""
        return [(int(self.starts[k]), int(self.stops[k])) for k in range(int(self.rows[i]), int(self.rows[i + 1]))]

    def pair(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i's (inputs, targets), seq_len each; the padding's are pad_id (`target_mask` says which count)."""
        import torch

        inputs = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        targets = inputs.copy()
        at = 0
        for a, b in self._pieces(i):
            tokens = np.asarray(self.tokens[a:b], dtype=np.int64)
            inputs[at:at + b - a - 1], targets[at:at + b - a - 1] = tokens[:-1], tokens[1:]
            at += b - a - 1
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def target_mask(self, i: int) -> torch.Tensor:
        """The pieces' targets count (the loss mask's, for chat data); the padding's do not."""
        import torch

        counted = np.zeros(self.seq_len, dtype=np.bool_)
        at = 0
        for a, b in self._pieces(i):
            counted[at:at + b - a - 1] = True if self.mask is None else np.asarray(self.mask[a + 1:b], dtype=np.bool_)
            at += b - a - 1
        return torch.from_numpy(counted)

    def row_documents(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row i's (positions, segments), seq_len each: positions restart at 0 at each piece and at the padding,
        which is one segment after the last piece's."""
        lengths = [b - a - 1 for a, b in self._pieces(i)]
        lengths.append(self.seq_len - sum(lengths))
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        segments = np.repeat(np.arange(len(lengths)), lengths)
        return np.arange(self.seq_len) - starts, segments

    def documents(self, ids: list[int]) -> Documents:
        """The documents of these rows (a micro-batch), (len(ids), seq_len) each."""
        import torch
        from trainyard.parallel.models.components.documents import Documents

        positions, segments = zip(*(self.row_documents(i) for i in ids), strict=True)
        return Documents(torch.from_numpy(np.stack(positions)), torch.from_numpy(np.stack(segments)))
