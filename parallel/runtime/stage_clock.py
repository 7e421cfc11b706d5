"""How the pipeline executor times its actions: on the device's own clock on a GPU, on the host's on a CPU.

On a CPU the work of an action is done when its call returns, so a host timer around it (`time.perf_counter`)
measures it. On a GPU the call only queues kernels: a host timer measures the queueing, and the bubble fraction
and the per-stage times computed from it (`actors.telemetry`) are wrong there. So on CUDA each span is a pair of
CUDA events recorded on the current stream around the action, and its seconds are read from the events'
`elapsed_time` after the step's one read from the device (`parallel.runtime.trainer`), when they are complete:
reading them then waits for nothing. `settle` adds them into the step's timings.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class StageClock:
    """Spans of named timing fields (`PipelineTimings`' `forward_s`, ...), summed per step."""

    def __init__(self, device: torch.device):
        self.on_device = device.type == "cuda"
        """CUDA events (True) or host timers (False)."""
        self._pending: list[tuple[str, Any, Any]] = []

    @contextmanager
    def span(self, timings: object, name: str) -> Iterator[None]:
        """Time the body into `timings.<name>`: now on the host, or at `settle` from CUDA events."""
        if not self.on_device:
            start = time.perf_counter()
            yield
            setattr(timings, name, getattr(timings, name) + time.perf_counter() - start)
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._pending.append((name, begin, end))

    def settle(self, timings: object) -> None:
        """Add the step's device-timed spans into `timings` (after the step's kernels are done; nothing on CPU)."""
        for name, begin, end in self._pending:
            end.synchronize()  # done already after the step's read: this waits for nothing
            setattr(timings, name, getattr(timings, name) + begin.elapsed_time(end) / 1e3)
        self._pending.clear()
