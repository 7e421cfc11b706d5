"""What a pipeline schedule kind is (`Schedule`: each rank's compute order, when it refuses a layout, how it places
virtual stages, whether it splits backwards) and the vocabulary of its compute orders (`Compute`: (F | B | I | W,
micro-batch, local chunk)). Each kind is a module of `parallel.plan.schedule.kinds`; `schedules.SCHEDULES` registers
them. Pure: no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainyard.parallel.plan.schedule.actions import ActionKind

Compute = tuple[ActionKind, int, int]
"""(F | B | I | W, microbatch, local chunk): one compute of a rank's order."""
F, B = ActionKind.FORWARD, ActionKind.BACKWARD
BI, BW = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


@dataclass(frozen=True)
class Schedule:
    """One schedule kind: each rank's compute order, and why it cannot serve a (pp, microbatches, vpp)."""

    name: str
    order: Callable[[int, int, int, int], list[Compute]]
    """(pp, microbatches, vpp, rank) -> that rank's forwards and backwards in order."""
    refuse: Callable[[int, int, int], str | None] = lambda pp, m, vpp: None
    """(pp, microbatches, vpp) -> the reason it cannot build them, or None."""
    placement: str = "interleaved"
    """Which virtual stages each rank's chunks are (`virtual_stage`)."""
    splits_backward: bool = False
    """Its backwards are input (I) and weight (W) halves run apart (`parallel.runtime.pipeline.split_backward`)."""
    flushes: bool = True
    """Each step drains the pipeline before the next starts; False (2bw): the next step's forwards run into the
    last one's backwards, so a step's bubble is the steady state's (`schedule_sim.steady_state`)."""
    delays_update: bool = False
    """Each step's gradient is of the weights one version old (2bw's double-buffered weights,
    `parallel.runtime.pipeline.weight_versions`): it changes the numbers, so the planner never picks it."""
