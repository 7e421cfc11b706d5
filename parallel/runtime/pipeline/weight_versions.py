"""PipeDream-2BW's two weight versions on a rank (`parallel.schedule: 2bw`): a step's forwards and backwards run
on the version one step old, and its gradient updates the newest, so w_{t+1} = w_t - lr * g(w_{t-1}) (the first
step's older version is the initial weights).

`WeightVersions.previous()` is a context around the step's compute: it puts the stashed version w_{t-1} into the
parameters (keeping w_t aside) and, on leaving, puts w_t back, for the optimizer to step with the gradients just
computed; `stepped()` then stashes w_t as the next step's older version. Every micro-batch of a step forwards and
backwards on the same stashed version, as in the paper. Copies in place (`copy_`), so the optimizer, the reducers'
bucket views and FSDP's shards keep their storage; the local shards of DTensors.

Written by hand: torch's pipelining has no weight stashing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor


class WeightVersions:
    """The older of a rank's two weight versions, and the newer while a step computes on the older."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        self.older = [p.detach().clone() for p in self.params]
        self._newer: list[torch.Tensor] | None = None

    @contextmanager
    def previous(self) -> Iterator[None]:
        """The step's compute on w_{t-1}; w_t back in the parameters after."""
        with torch.no_grad():
            self._newer = [p.detach().clone() for p in self.params]
            for p, old in zip(self.params, self.older, strict=True):
                p.copy_(old)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, new in zip(self.params, self._newer, strict=True):
                    p.copy_(new)

    def stepped(self) -> None:
        """The optimizer stepped w_t to w_{t+1}: w_t is the next step's older version."""
        assert self._newer is not None, "stepped() follows a step computed under previous()"
        self.older, self._newer = self._newer, None

    def took_state(self) -> None:
        """The parameters were replaced (a checkpoint's load): the older version is them too (the one-step lag
        restarts)."""
        with torch.no_grad():
            self.older = [p.detach().clone() for p in self.params]
