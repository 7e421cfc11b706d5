"""The offloaded optimizer's host steps run behind the next forward (ZeRO-Offload's overlap): `HostSteps` runs
each chunk's CPU step (and its copy back to the device) on a thread of its own, in the order they were queued,
and `wait_in_forward` makes each unit of the model's forward (`DecoderStage.shard_units`: the embedding, each
block, the head) wait, from a forward pre-hook, for the chunks holding that unit's parameters. So the host steps
the last units while the next step's forward already runs through the first ones, and nothing reads a parameter
before its update landed: the numerics are those of the step run in place.

Why a thread, not a process: the chunk steps are torch ops on host tensors, which release the GIL while they
compute, and they update the optimizer's own state in place (a process would have to own and ship it).
Anything else that reads the parameters or the optimizer's state outside the forward settles first
(`HostSteps.settle`: the trainer before the next step's clipping and learning rate, `RankState`'s moves of the
state, checkpoints, `steps_done`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn


class HostSteps:
    """Chunk steps queued on one background thread; `wait(chunks)` and `settle()` wait for them (re-raising what
    one raised)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future[None]] = {}

    def submit(self, chunk: int, work: Callable[[], None]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-step")
        self._pending[chunk] = self._pool.submit(_without_grad, work)

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def wait(self, chunks: Sequence[int]) -> None:
        for chunk in chunks:
            future = self._pending.pop(chunk, None)
            if future is not None:
                future.result()

    def settle(self) -> None:
        """Every queued step done (in queue order, so an error is the first one's)."""
        self.wait(sorted(self._pending))


def _without_grad(work: Callable[[], None]) -> None:
    with torch.no_grad():  # grad mode is per thread: the copies into the parameters must not be recorded
        work()


def wait_in_forward(units: Sequence[Sequence[nn.Module]], ready: Callable[[int], None]) -> None:
    """Before any module of `units[i]` runs its forward, `ready(i)` (every module of a unit: a unit's forward
    may call them in any order; after the first, `ready` finds nothing left to wait for)."""
    for i, unit in enumerate(units):
        for module in unit:
            module.register_forward_pre_hook(lambda _module, _args, i=i: ready(i))


def forward_units(chunks: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """The units of each chunk's forward in the order they run (`DecoderStage.shard_units`; a unit listed twice,
    tied embeddings on one stage, once)."""
    units: list[list[nn.Module]] = []
    for chunk in chunks:
        for unit in chunk.shard_units():  # type: ignore[operator]  # a DecoderStage (no import: rooms)
            if not any(unit is seen for seen in units):
                units.append(unit)
    return units
