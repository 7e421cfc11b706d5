"""Datasets: a dataset maps a sample id to `seq_len + 1` token ids (inputs and shifted targets).

Which ids a step reads is `parallel.data.sampler`'s (from (seed, step) alone, so every layout trains on the same
sequences in the same steps; a worker reads only the samples it is given).

- synthetic: seeded random tokens, one generator per sample id (for benchmarks; nothing to learn).
- text: a UTF-8 file read as bytes (byte-level tokens, vocab 256); sample id = start offset.
- tokens: a flat binary of uint16/uint32 token ids (nanoGPT's train.bin), memory-mapped, or a directory
  `trainyard prepare` wrote (`parallel.data.token_dir`: its shards read as one stream, dtype and vocabulary from
  its manifest, and for chat data a loss mask).
- a mixture (`data.sources`): the sample id space [0, MIXTURE_SPACE) is cut into one range per source,
  sized by weight; id u falls in source k's range and picks the sample at the same relative place in
  source k. The sampler is unchanged (uniform ids from (seed, step)), so a mixture's samples are as
  layout-independent as one dataset's, and source k is drawn with probability weight_k / sum of weights.

Loss mask: a chat dataset's target at a masked position (a prompt or user token) is -100, which the
stages' summed cross-entropy ignores; `counted_targets` is the number of targets that count in a set of
samples, which the trainer divides the loss by (the global batch's, derived from its sample ids: the same
number on every rank and layout, with no communication).

Whole examples (`data.packing` set; `parallel.data.examples`, packed into rows: `parallel.data.packing`): the
documents of one prepared directory, each seen once per epoch, the held-out ones the last VAL_FRACTION.

Validation: `data.val_path` when given (a file or directory; a mixture then validates on it alone); else,
with eval on, the last VAL_FRACTION of the tokens of `path`, or of each source of a mixture (the same mixture
over the held-out tails), none of which is trained on.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from trainyard.parallel.config import JobConfig, RuleError
from trainyard.parallel.data.examples import ExampleDataset, pieces
from trainyard.parallel.data.packing import PackedDataset
from trainyard.parallel.data.sampler import step_batch_ids
from trainyard.parallel.data.token_dir import (
    DTYPES,
    Manifest,
    Segments,
    check_directory,
    document_ends,
    open_streams,
)
from trainyard.parallel.seeds import derive_seed

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is made (in the ranks), not here: the service opens datasets to check a job at
# submit, and must not pay torch's import for that.


class DatasetError(RuleError):
    """A dataset that is missing or does not fit the model (e.g. a token id >= vocab_size)."""


IGNORE = -100
"""The target of a position the loss does not count (torch's cross_entropy ignore_index)."""
MIXTURE_SPACE = 2**48
"""Sample ids of a mixture: far more than any source's samples, so each source's range maps onto its samples
evenly (a sample is drawn at most one id more often than another, in ranges of ~2**48 ids)."""


@dataclass
class TokenDataset:
    """Sample i is tokens[i : i + seq_len + 1] of one flat array (a memory map for files)."""

    tokens: np.ndarray | Segments
    seq_len: int
    vocab_size: int
    source: str
    mask: np.ndarray | Segments | None = None
    """Chat data: 1 where a token counts in the loss (as a target), 0 where it does not."""
    field: str = "data.path"
    """The spec field naming this data, for errors."""
    manifest: Manifest | None = None
    """A prepared directory's manifest."""

    @property
    def num_samples(self) -> int:
        return len(self.tokens) - self.seq_len

    def sample(self, i: int) -> torch.Tensor:
        import torch

        window = torch.from_numpy(np.asarray(self.tokens[i : i + self.seq_len + 1], dtype=np.int64))
        bad = window >= self.vocab_size
        if bad.any():
            # Neither the id nor where it is: an error never quotes the data (`service.tenancy.access`).
            raise DatasetError(self.field, f"{self.source} holds token ids outside model.vocab_size="
                                           f"{self.vocab_size} (ids are 0 to vocab_size - 1)")
        return window

    def target_mask(self, i: int) -> torch.Tensor | None:
        """Which of sample i's seq_len targets count in the loss (None: all of them)."""
        if self.mask is None:
            return None
        import torch

        return torch.from_numpy(np.asarray(self.mask[i + 1 : i + self.seq_len + 1], dtype=np.bool_))


@dataclass
class SyntheticDataset:
    seed: int
    seq_len: int
    vocab_size: int
    num_samples: int = 1 << 30

    def sample(self, i: int) -> torch.Tensor:
        import torch

        gen = torch.Generator().manual_seed(derive_seed(self.seed, "synthetic", i))
        return torch.randint(self.vocab_size, (self.seq_len + 1,), generator=gen)

    def target_mask(self, i: int) -> None:
        return None


@dataclass
class MixtureDataset:
    """Several token datasets drawn from by weight (see the module docstring)."""

    parts: list[TokenDataset]
    weights: list[float]
    bounds: list[int] = field(init=False)
    """Source k's ids are [bounds[k], bounds[k + 1])."""
    num_samples: int = MIXTURE_SPACE

    def __post_init__(self) -> None:
        total, running, self.bounds = sum(self.weights), 0.0, [0]
        for w in self.weights:
            running += w
            self.bounds.append(round(MIXTURE_SPACE * running / total))
        self.bounds[-1] = MIXTURE_SPACE

    def locate(self, i: int) -> tuple[int, int]:
        """(source, sample id in it) of mixture sample id i."""
        k = bisect.bisect_right(self.bounds, i) - 1
        lo, hi = self.bounds[k], self.bounds[k + 1]
        return k, (i - lo) * self.parts[k].num_samples // (hi - lo)

    def sample(self, i: int) -> torch.Tensor:
        k, j = self.locate(i)
        return self.parts[k].sample(j)

    def target_mask(self, i: int) -> torch.Tensor | None:
        k, j = self.locate(i)
        return self.parts[k].target_mask(j)

    @property
    def has_mask(self) -> bool:
        return any(p.mask is not None for p in self.parts)


Dataset = TokenDataset | SyntheticDataset | MixtureDataset | ExampleDataset | PackedDataset


VAL_FRACTION = 0.05
"""With eval on and no `data.val_path`, the last 5% of a text or tokens file (or directory, or each source of a
mixture) is held out for validation."""


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
    if data.sources is not None and data.path is not None:
        raise DatasetError("data.sources", "give data.path or data.sources, not both")
    if data.sources is not None and data.kind != "tokens":
        raise DatasetError("data.sources", f"a mixture of sources is for data.kind=tokens, not {data.kind}")
    held_out = not data.val_path and config.eval.every > 0
    if data.epochs is not None and data.packing is None:
        raise DatasetError("data.epochs", "epochs count passes over whole examples: set data.packing (false: "
                                          "each example in its own padded sequence)")
    if data.packing is not None:
        return _open_examples(config, split, held_out)
    if split == "val" and data.val_path:
        val = _open_one(config, "data.val_path", data.val_path, None)
        if val.manifest is not None:  # a prepared directory: its ids mean what the training data's mean (only
            # their manifests are read: the training data itself is opened, and checked, by its own call)
            training = [(name, str(resolve_path(p)), _manifest_or_none(resolve_path(p)))
                        for name, p in _training_paths(config)]
            _same_tokenizer([*training, (val.field, val.source, val.manifest)])
        return val
    if data.sources is None:
        assert data.path is not None
        return _open_one(config, "data.path", data.path, split if held_out else None)
    parts = [_open_one(config, name, p, split if held_out else None) for name, p in _training_paths(config)]
    _same_tokenizer([(p.field, p.source, p.manifest) for p in parts])
    return MixtureDataset(parts, [s.weight for s in data.sources])


def _open_examples(config: JobConfig, split: str, held_out: bool) -> ExampleDataset | PackedDataset:
    """The whole examples of `data.path` (or, for validation, of `data.val_path`, or the held-out last
    VAL_FRACTION of `data.path`'s documents), packed with `packing: true`."""
    data = config.data
    if data.kind != "tokens" or data.sources is not None:
        raise DatasetError("data.packing", "whole examples are read from one `trainyard prepare` directory: "
                                           "data.kind: tokens with data.path")
    field, path_text = ("data.val_path", data.val_path) if split == "val" and data.val_path else ("data.path",
                                                                                                 data.path)
    assert path_text is not None
    path = resolve_path(path_text)
    if not path.is_dir():
        raise DatasetError(field, f"{path} is not a `trainyard prepare` directory: whole examples (data.packing) "
                                  "need its document index")
    tokens, mask, manifest = _read_directory(config, field, path)
    if manifest.document_ends is None:
        raise DatasetError(field, f"{path} was prepared before documents.bin (where each example ends) existed: "
                                  "run `trainyard prepare` again")
    ends = document_ends(path, manifest)
    begin = 0  # where the first document read starts
    if held_out and field == "data.path":
        cut = len(ends) - max(1, round(len(ends) * VAL_FRACTION))
        if cut < 1:
            raise DatasetError(field, f"{path} holds {len(ends)} example(s): too few to hold some out for eval; "
                                      "give data.val_path")
        begin, ends = (int(ends[cut - 1]), ends[cut:]) if split == "val" else (0, ends[:cut])
    starts, stops, cut_examples = pieces(ends, config.model.seq_len, begin)
    if len(starts) == 0:
        raise DatasetError(field, f"{path} holds no example with a target (every document is one token)")
    return (PackedDataset if data.packing else ExampleDataset)(
        tokens=tokens, starts=starts, stops=stops, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size,
        source=str(path), pad_id=manifest.eos_id, mask=mask, field=field, manifest=manifest, cut_examples=cut_examples)


def _training_paths(config: JobConfig) -> list[tuple[str, str]]:
    """(field, path) of each training source: data.path, or each of data.sources."""
    data = config.data
    if data.sources is None:
        return [("data.path", data.path)] if data.path is not None else []
    return [(f"data.sources.{k}.path", s.path) for k, s in enumerate(data.sources)]


def _manifest_or_none(path: Path) -> Manifest | None:
    """The manifest of a prepared directory; None for a file, or one whose manifest its own opening reports."""
    try:
        return Manifest.read(path) if path.is_dir() else None
    except ValueError:
        return None


def _open_one(config: JobConfig, field: str, path_text: str, split: str | None) -> TokenDataset:
    """One file or directory; `split` (train or val) cuts off or keeps the held-out tail, None keeps all."""
    path, seq_len = resolve_path(path_text), config.model.seq_len
    tokens, mask, manifest = _read_tokens(config, field, path)
    if split is not None:
        cut = int(len(tokens) * (1 - VAL_FRACTION))
        a, b = (cut, len(tokens)) if split == "val" else (0, cut)
        tokens, mask = _part(tokens, a, b), (mask.sub(a, b) if mask is not None else None)
    ds = TokenDataset(tokens=tokens, seq_len=seq_len, vocab_size=config.model.vocab_size, source=str(path),
                      mask=mask, field=field, manifest=manifest)
    if ds.num_samples < 1:
        what = f"its {split} split holds" if split is not None else "holds"
        raise DatasetError(field, f"{path} {what} too few tokens: seq_len={seq_len} needs at least {seq_len + 1}")
    return ds


def _part(array: np.ndarray | Segments, a: int, b: int) -> np.ndarray | Segments:
    return array.sub(a, b) if isinstance(array, Segments) else array[a:b]


def _read_tokens(config: JobConfig, field: str, path: Path
                 ) -> tuple[np.ndarray | Segments, Segments | None, Manifest | None]:
    data = config.data
    if path.is_dir() and data.kind == "tokens":
        return _read_directory(config, field, path)
    if path.is_dir():  # kind text (a directory of tokens was read above)
        raise DatasetError(field, f"{path} is a directory; data.kind: text reads one file of bytes (a `trainyard "
                                  "prepare` directory is data.kind: tokens)")
    if not path.is_file():
        raise DatasetError(field, f"file not found: {path}")
    if data.kind == "text":
        return (np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)), None, None
    itemsize = np.dtype(DTYPES[data.dtype]).itemsize
    if path.stat().st_size % itemsize:
        raise DatasetError("data.dtype", f"{path} is not a whole number of {data.dtype} token ids")
    if not path.stat().st_size:  # numpy cannot map an empty file; _open_one says it holds too few tokens
        return np.zeros(0, DTYPES[data.dtype]), None, None
    return np.memmap(path, dtype=DTYPES[data.dtype], mode="r"), None, None


def _read_directory(config: JobConfig, field: str, path: Path) -> tuple[Segments, Segments | None, Manifest]:
    """A `trainyard prepare` directory, checked against the model: its files are there and its vocabulary fits."""
    found = check_directory(path)
    if isinstance(found, str):
        raise DatasetError(field, found)
    vocab = config.model.vocab_size
    if found.vocab_size > vocab:
        raise DatasetError(field, f"{path} was tokenized with a vocabulary of {found.vocab_size} ids, more than "
                                  f"model.vocab_size={vocab}: set model.vocab_size >= {found.vocab_size}")
    tokens, mask = open_streams(path, found)
    return tokens, mask, found


def _same_tokenizer(parts: list[tuple[str, str, Manifest | None]]) -> None:
    """The sources (field, path, manifest) of a mixture (and `data.val_path`) that are prepared directories come
    from one tokenizer (ids mean the same)."""
    prepared = [(name, source, manifest) for name, source, manifest in parts if manifest is not None]
    if not prepared:
        return
    first_name, first_source, first = prepared[0]
    for name, source, manifest in prepared[1:]:
        if manifest.tokenizer["sha256"] != first.tokenizer["sha256"]:
            raise DatasetError(name, f"{source} was tokenized with another tokenizer than {first_source} "
                                      f"({first_name}): their token ids do not mean the same")


def has_loss_mask(ds: Dataset) -> bool:
    """Whether some targets may not count: chat data's prompts, whole examples' padding."""
    return (isinstance(ds, MixtureDataset) and ds.has_mask) or (isinstance(ds, TokenDataset) and ds.mask is not None) \
        or isinstance(ds, ExampleDataset)


def counted_targets(ds: Dataset, ids: list[int]) -> int:
    """How many targets of these samples count in the loss (all seq_len of each without a loss mask)."""
    seq_len = ds.parts[0].seq_len if isinstance(ds, MixtureDataset) else ds.seq_len
    if not has_loss_mask(ds):
        return len(ids) * seq_len
    total = 0
    for i in ids:
        m = ds.target_mask(i)
        total += seq_len if m is None else int(m.sum())
    return total


def step_counted_targets(config: JobConfig, ds: Dataset, step: int) -> int:
    """The targets that count in step `step`'s global batch: what every rank divides its loss by."""
    return counted_targets(ds, step_batch_ids(config, step, ds.num_samples))


def load_batch(ds: Dataset, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (len(ids), seq_len) int64; targets the loss does not count are IGNORE."""
    import torch

    pairs = [ds.pair(i) for i in ids] if isinstance(ds, PackedDataset) else \
        [(s[:-1], s[1:]) for s in (ds.sample(i) for i in ids)]  # a packed row is not one shifted window
    inputs, targets = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    if has_loss_mask(ds):
        masks = [ds.target_mask(i) for i in ids]
        counted = torch.stack([torch.ones(targets.shape[1], dtype=torch.bool) if m is None else m for m in masks])
        targets = targets.masked_fill(~counted, IGNORE)
    return inputs, targets
