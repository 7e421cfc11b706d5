"""How trainyard's parameters sit in a Hugging Face checkpoint: the state-dict adapter's common part.

Each model family's `hf.py` (`parallel/models/<family>/hf.py`) says, per trainyard parameter name, where its
values live in a Hugging Face checkpoint as a `Source`: the HF tensor's name, whether HF stores it transposed
(GPT-2's Conv1D keeps weights as in x out), and whether it is one piece of a fused HF tensor (GPT-2's c_attn
is q|k|v side by side; a fused expert tensor holds every expert along its first dimension). That one table
serves both directions (torchtitan's `to_hf` / `from_hf`), and, because a source maps any rectangular block
of a trainyard tensor onto a block of the HF tensor (`hf_block`), it also serves the sliced reading where a
rank fetches only its tensor-parallel shard of each tensor (`parallel.io.hf_checkpoint`).

Pure: names, index arithmetic and tensor reshuffling; no file is opened here. A family's `config_from_hf` raises
`NotNative` (`parallel.config`) for a field it does not implement.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from trainyard.parallel.config import ModelConfig, RuleError


@dataclass(frozen=True)
class Source:
    """Where one trainyard tensor lives in a Hugging Face checkpoint."""

    key: str
    """The HF tensor's name."""
    transpose: bool = False
    """HF stores it transposed (a 2-D Conv1D weight, in x out); `dim` and `start` are in trainyard's orientation."""
    expert: int | None = None
    """A fused expert tensor: this tensor is its entry `expert` along dim 0."""
    dim: int = 0
    """(Trainyard orientation, after taking the expert.) The dim along which this tensor is a piece of `key`."""
    start: int = 0
    """Where the piece starts along `dim`; 0 and the whole extent for a tensor that is all of `key`."""


Block = tuple[tuple[int, int], ...]
"""A rectangular block of a tensor: (start, stop) per dimension."""


def hf_block(source: Source, block: Block) -> Block:
    """The block of the HF tensor that holds `block` of the trainyard tensor `source` describes."""
    moved = list(block)
    start, stop = moved[source.dim]
    moved[source.dim] = (start + source.start, stop + source.start)
    if source.transpose:
        moved.reverse()
    if source.expert is not None:
        moved.insert(0, (source.expert, source.expert + 1))
    return tuple(moved)


def from_hf_block(source: Source, hf: torch.Tensor) -> torch.Tensor:
    """The HF tensor's block (as `hf_block` chose it) in trainyard's orientation."""
    if source.expert is not None:
        hf = hf[0]
    return hf.t() if source.transpose else hf


def whole(shape: Collection[int]) -> Block:
    return tuple((0, n) for n in shape)


class HFAdapter(Protocol):
    """A model family's Hugging Face mapping (its `hf.py` module satisfies this)."""

    FAMILY: str
    ARCHITECTURES: tuple[str, ...]
    """The `architectures` of config.json this family reads; the first is what it writes."""
    MODEL_TYPES: tuple[str, ...]
    """config.json's `model_type` of each of `ARCHITECTURES` (another model_type is another model)."""

    def config_from_hf(self, hf: Mapping) -> dict:
        """config.json -> the ModelConfig fields it fixes (the architecture). Raises NotNative naming a config.json
        field the family does not implement, RuleError naming one it cannot read."""

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """ModelConfig -> config.json. Raises RuleError naming the model field HF cannot express."""

    def sources(self, cfg: ModelConfig, hf_keys: Collection[str] | None = None) -> dict[str, Source]:
        """Every trainyard parameter name (a tied head too) -> its Source. `hf_keys`: the names a checkpoint
        holds, where the family reads several spellings; None: the spelling it writes."""

    def ignored(self, key: str) -> bool:
        """An HF tensor that is no parameter (a stored attention mask, rotary frequencies)."""


def from_hf(state: Mapping[str, torch.Tensor], sources: Mapping[str, Source]) -> dict[str, torch.Tensor]:
    """Whole HF tensors -> whole trainyard tensors (each a new contiguous tensor)."""
    out = {}
    for name, source in sources.items():
        hf = state[source.key]
        t = from_hf_block(source, hf[source.expert:source.expert + 1] if source.expert is not None else hf)
        length = _piece_length(name, source, sources, hf)
        out[name] = t.narrow(source.dim, source.start, length).contiguous().clone()
    return out


def to_hf(state: Mapping[str, torch.Tensor], sources: Mapping[str, Source]) -> dict[str, torch.Tensor]:
    """Whole trainyard tensors -> whole HF tensors: pieces concatenated, experts stacked, Conv1D transposed.
    Names sharing one HF tensor twice over (a tied head and embedding) must hold equal values."""
    by_key: dict[str, dict[tuple[int | None, int], torch.Tensor]] = defaultdict(dict)
    for name, source in sources.items():
        pieces = by_key[source.key]
        place = (source.expert, source.start)
        if place in pieces:
            if not torch.equal(pieces[place], state[name]):
                raise ValueError(f"{name} is tied to {source.key} but holds other values")
            continue
        pieces[place] = state[name]
    out = {}
    for key, pieces in by_key.items():
        some = next(s for s in sources.values() if s.key == key)
        experts = sorted({e for e, _ in pieces}, key=lambda e: -1 if e is None else e)
        rows = [torch.cat([pieces[(e, s)] for s in sorted(s for f, s in pieces if f == e)], dim=some.dim)
                for e in experts]
        t = torch.stack(rows) if some.expert is not None else rows[0]
        if some.transpose:
            t = t.t()
        out[key] = t.contiguous()
    return out


def _piece_length(name: str, source: Source, sources: Mapping[str, Source], hf: torch.Tensor) -> int:
    """How far along `dim` the piece reaches: to the next piece of the same HF tensor, or its end."""
    extent = from_hf_block(source, hf[:1] if source.expert is not None else hf).shape[source.dim]
    later = [s.start for s in sources.values()
             if s.key == source.key and s.expert == source.expert and s.start > source.start]
    return (min(later) if later else extent) - source.start


def hf_bool(hf: Mapping, key: str, default: bool) -> bool:
    """A boolean field of config.json; another type is a RuleError naming it (transformers refuses it, and read
    as truthy, e.g. "false", `tie_word_embeddings` would drop a stored head)."""
    value = hf.get(key, default)
    if not isinstance(value, bool):
        raise RuleError(key, f"is {value!r}, not true or false")
    return value
