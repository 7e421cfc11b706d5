"""A step's figures between the step's queueing and their read to the host, which comes one step late (issue 48,
item 2): `RankTrainer.queue_step` ends a step with its loss, gradient norm and MoE statistics stacked into one
device tensor (`Figures`), and the rank reads them only once the next step's work is queued behind them
(`parallel.runtime.driver`), so the device never idles between two steps while the host waits.

On CUDA `stage` copies the stacked tensor (non_blocking) into pinned host memory and records an event behind the
copy: reading then waits on that event alone, which the device passed before it started the next step's kernels.
On CPU the tensor is the host's already (every kernel has run when its call returns): the same numbers and the
same order of work, only the read moves. The step's other figures (lr, the host timings, byte counts) are known
on the host when it is queued and wait here beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from trainyard.parallel.runtime.pipeline.pipeline import PipelineTimings


@dataclass
class Figures:
    """Step `step`'s figures, queued: `values` (its loss if this rank has it, the gradient norm, the MoE
    statistics' rows, float64) on the host once `ready` has passed (None: already there)."""

    step: int
    values: torch.Tensor
    ready: Any
    """The CUDA event recorded behind the copy to pinned memory; None on CPU."""
    has_loss: bool
    lr: float
    timings: PipelineTimings
    spans: list = field(default_factory=list)
    """The step's device-timed pipeline spans (`StageClock.detach`), settled into `timings` at the read."""
    host: dict = field(default_factory=dict)
    """The rest of the step's `StepStats` fields, known on the host as it was queued."""

    def read(self) -> tuple[float | None, float, list[float]]:
        """The loss (None where this rank has none), the gradient norm and the MoE statistics: the step's one
        read from the device, waiting only for its own figures' copy."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.values.tolist()
        loss = values.pop(0) if self.has_loss else None
        return loss, values.pop(0), values


def stage(values: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """`values` on their way to the host without waiting: on CUDA a non_blocking copy into pinned memory and the
    event behind it; on CPU the tensor itself and no event."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
