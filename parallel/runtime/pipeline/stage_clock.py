"""How the pipeline executor times its actions: on the device's own clock on a GPU, on the host's on a CPU.

On a CPU the work of an action is done when its call returns, so a host timer around it (`time.perf_counter`)
measures it. On a GPU the call only queues kernels: a host timer measures the queueing, and the bubble fraction
and the per-stage times computed from it (`actors.telemetry`) are wrong there. So on CUDA each span is a pair of
CUDA events recorded on the current stream around the action, and its seconds are read from the events'
`elapsed_time` after the step's one read from the device, when they are complete: reading them then waits for
nothing. That read comes one step late (`parallel.runtime.step.step_figures`), after the next step's spans are recorded:
`detach` hands a step's spans over as it is queued, and `settle` adds them into its timings at the read.
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

    def detach(self) -> list[tuple[str, Any, Any]]:
        """The device-timed spans recorded since the last `detach` or `settle` (a step's), no longer held here."""
        spans, self._pending = self._pending, []
        return spans

    def settle(self, timings: object, spans: list[tuple[str, Any, Any]] | None = None) -> None:
        """Add device-timed spans (`spans`, else those held) into `timings`, after their kernels are done
        (nothing on CPU)."""
        for name, begin, end in self.detach() if spans is None else spans:
            end.synchronize()  # done already after the step's read: this waits for nothing
            setattr(timings, name, getattr(timings, name) + begin.elapsed_time(end) / 1e3)
