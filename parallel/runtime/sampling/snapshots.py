"""Sampler weights at named save points: copies of a model's trainable parameters (a LoRA client's adapters) taken
in memory, on the parameters' device, under a name (`save`); a sample under that name runs with them swapped in
and the live ones put back after (`swapped_in`), so training goes on from its own weights whatever was sampled in
between. No file is written: the weights move from trainer to sampler inside the rank.

The frozen weights (the base) are shared by every snapshot, never copied. How many snapshots a client keeps is the
caller's to bound (`params.MAX_NAMED`, `params.MAX_EPHEMERAL`); `drop` forgets one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class Snapshots:
    """The named snapshots of one model's trainable parameters."""

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.saved: dict[str, list[torch.Tensor]] = {}

    @torch.no_grad()
    def save(self, name: str) -> None:
        """The trainable parameters' values now, under `name` (replacing what it held)."""
        self.saved[name] = [p.detach().clone() for p in self.params]

    def drop(self, name: str) -> None:
        self.saved.pop(name, None)

    @contextlib.contextmanager
    def swapped_in(self, name: str | None) -> Iterator[None]:
        """The parameters hold snapshot `name` inside (None: the live ones, untouched); the live values come back
        after, even when the body raises. KeyError for a name never saved (or dropped)."""
        if name is None:
            yield
            return
        saved = self.saved[name]
        with torch.no_grad():
            live = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, saved, strict=True):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, live, strict=True):
                    p.copy_(v)
