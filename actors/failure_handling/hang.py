"""How long a step may take before it counts as hung: `HangPolicy`, from the job's `fault` settings and the step
times recorded so far."""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.parallel.config import FaultConfig

HANG_WINDOW = 20
"""The recent steps whose median the hang detector reads."""
HANG_MIN_STEPS = 3
"""Steps recorded before the hang detector trusts their median (the first steps include warm-up)."""


@dataclass(frozen=True)
class HangPolicy:
    fault: FaultConfig

    def deadline(self, recent_step_times: list[float]) -> float:
        """How long a step may take before it counts as hung: hang_factor x the median of the recent steps
        (with a floor), once there are a few; never more than step_timeout_s."""
        recent = sorted(recent_step_times[-HANG_WINDOW:])
        if len(recent) < HANG_MIN_STEPS:
            return self.fault.step_timeout_s
        median = recent[len(recent) // 2]
        return min(self.fault.step_timeout_s, max(self.fault.hang_floor_s, self.fault.hang_factor * median))
