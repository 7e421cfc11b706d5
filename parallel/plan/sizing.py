"""`Sizing`: a layout and the job's config read as one object, which is what the memory and FLOP counting
reads (`plan.tp`, `plan.stage_layers`, `plan.config.model`, ...). A `parallel.plan.Plan` reads the same way.

Its own module, below `memory` and the model families: counting code types its argument with it instead of
importing `parallel.plan` (which imports the memory plan: that was the circle). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.parallel.config import JobConfig
from trainyard.parallel.plan.layout import Layout


@dataclass(frozen=True)
class Sizing:
    """What the counting reads: a layout's attributes (`plan.tp`, `plan.stage_layers`, ...) and `plan.config`."""

    layout: Layout
    config: JobConfig

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("layout", "config"):
            raise AttributeError(name)
        return getattr(self.layout, name)
