"""Datasets and the layout-independent sampler.

A dataset maps a sample id to `seq_len + 1` token ids (inputs and shifted targets). The sampler picks
the sample ids of step s's global batch from (seed, step) alone, so every layout trains on the same
sequences in the same steps; `rank_share` cuts the global batch into a data-parallel rank's micro-batches,
and a worker reads only the samples it is given.

- synthetic: seeded random tokens, one generator per sample id (for benchmarks; nothing to learn).
- text: a UTF-8 file read as bytes (byte-level tokens, vocab 256); sample id = start offset.
- tokens: a flat binary of uint16/uint32 token ids (nanoGPT's train.bin), memory-mapped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from parallel.config import JobConfig, RuleError
from parallel.seeds import derive_seed

if TYPE_CHECKING:
    from parallel.plan import Plan


class DatasetError(RuleError):
    """A dataset that is missing or does not fit the model (e.g. a token id >= vocab_size)."""


_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass
class TokenDataset:
    """Sample i is tokens[i : i + seq_len + 1] of one flat array (a memory map for files)."""

    tokens: np.ndarray
    seq_len: int
    vocab_size: int
    source: str

    @property
    def num_samples(self) -> int:
        return len(self.tokens) - self.seq_len

    def sample(self, i: int) -> torch.Tensor:
        window = torch.from_numpy(np.asarray(self.tokens[i : i + self.seq_len + 1], dtype=np.int64))
        bad = window >= self.vocab_size
        if bad.any():
            raise DatasetError("data.path", f"{self.source} holds token id {int(window[bad][0])} at offset "
                                            f"{i + int(bad.nonzero()[0, 0])}, outside vocab_size={self.vocab_size}")
        return window


@dataclass
class SyntheticDataset:
    seed: int
    seq_len: int
    vocab_size: int
    num_samples: int = 1 << 30

    def sample(self, i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "synthetic", i))
        return torch.randint(self.vocab_size, (self.seq_len + 1,), generator=gen)


Dataset = TokenDataset | SyntheticDataset


VAL_FRACTION = 0.05
"""With eval on and no `data.val_path`, the last 5% of a text or tokens file is held out for validation."""


def resolve_path(path: str) -> Path:
    return Path(os.path.expanduser(path)).resolve()


def open_dataset(config: JobConfig, split: str = "train") -> Dataset:
    """Open (memory-map) the job's training or validation data; raises DatasetError naming the field when it
    is unusable. Validation data is `data.val_path`, else (with eval on) the tail the training split leaves
    out; synthetic data draws validation sequences from their own seed stream."""
    data, seq_len, vocab = config.data, config.model.seq_len, config.model.vocab_size
    if data.kind == "synthetic":
        return SyntheticDataset(seed=derive_seed(config.seed, "validation") if split == "val" else config.seed,
                                seq_len=seq_len, vocab_size=vocab)
    field, path = ("data.val_path", data.val_path) if split == "val" and data.val_path else ("data.path", data.path)
    assert path is not None
    tokens = _read_tokens(config, field, resolve_path(path))
    if not data.val_path and config.eval.every > 0:
        cut = int(len(tokens) * (1 - VAL_FRACTION))
        tokens = tokens[cut:] if split == "val" else tokens[:cut]
    ds = TokenDataset(tokens=tokens, seq_len=seq_len, vocab_size=vocab, source=str(path))
    if ds.num_samples < 1:
        what = f"its {split} split holds" if not data.val_path and config.eval.every > 0 else "holds"
        raise DatasetError(field, f"{path} {what} {len(tokens)} tokens; seq_len={seq_len} needs at least "
                                  f"{seq_len + 1}")
    return ds


def _read_tokens(config: JobConfig, field: str, path: Path) -> np.ndarray:
    data = config.data
    if not path.is_file():
        raise DatasetError(field, f"file not found: {path}")
    if data.kind == "text":
        return np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    itemsize = np.dtype(_DTYPES[data.dtype]).itemsize
    if path.stat().st_size % itemsize:
        raise DatasetError("data.dtype", f"{path} is {path.stat().st_size} bytes, not a whole number of "
                                         f"{data.dtype} token ids")
    return np.memmap(path, dtype=_DTYPES[data.dtype], mode="r")


def validation_batches(config: JobConfig, num_samples: int) -> list[list[int]]:
    """The sample ids of each validation batch (`eval.batches` of global_batch sequences): spread evenly over
    the validation data and the same at every evaluation, so val_loss is comparable across steps."""
    count = config.eval.batches * config.global_batch
    ids = [i * num_samples // count for i in range(count)] if num_samples >= count else \
        [i % num_samples for i in range(count)]
    return [ids[b * config.global_batch:(b + 1) * config.global_batch] for b in range(config.eval.batches)]


def global_batch_ids(seed: int, step: int, global_batch: int, num_samples: int) -> list[int]:
    """Sample ids of step `step`'s global batch: a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "batch", step))
    return torch.randint(num_samples, (global_batch,), generator=gen).tolist()


def step_microbatches(plan: Plan, rank: int, step: int, num_samples: int) -> list[list[int]]:
    """The sample ids of `rank`'s micro-batches in step `step`: its data-parallel share of the global batch
    (what the coordinator sends the rank; it computes the global batch once for all ranks)."""
    cfg = plan.config
    ids = global_batch_ids(cfg.seed, step, cfg.global_batch, num_samples)
    return rank_share(ids, plan.coords(rank).dp, plan.dp, plan.microbatches)


def rank_share(ids: list[int], dp_rank: int, dp: int, microbatches: int) -> list[list[int]]:
    """The micro-batches of data-parallel rank `dp_rank`: a contiguous slice of the global batch, split evenly."""
    per_rank = len(ids) // dp
    mine = ids[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    size = per_rank // microbatches
    return [mine[i * size : (i + 1) * size] for i in range(microbatches)]


def load_batch(ds: Dataset, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (len(ids), seq_len) int64."""
    seqs = torch.stack([ds.sample(i) for i in ids])
    return seqs[:, :-1], seqs[:, 1:]
