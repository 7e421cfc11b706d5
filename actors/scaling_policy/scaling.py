"""Whether to resize, from what is free in the cluster: `FixedScaling` never does, `ElasticScaling` grows an
elastic job (parallel.dp = {min, max}) into the groups that are free, to the largest size the plan's rules allow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from trainyard.parallel.plan import Plan, PlanError, make_plan, resized


@dataclass(frozen=True)
class NoopDecision:
    reason: str = ""


@dataclass(frozen=True)
class ResizeDecision:
    dp: int
    reason: str


def largest_size(plan: Plan, at_most: int) -> int | None:
    """The largest data-parallel size <= at_most within the job's range that every plan rule allows."""
    assert plan.dp_range is not None, "an elastic job's"
    low, high = plan.dp_range
    for size in range(min(at_most, high), low - 1, -1):
        try:
            make_plan(resized(plan.config, size))  # every rule, e.g. ep must divide dp
            return size
        except PlanError:
            continue
    return None


class ScalingPolicy(Protocol):
    def decide(self, plan: Plan, free_groups: int) -> NoopDecision | ResizeDecision:
        """Whether `plan`'s job resizes, given `free_groups` bundles of its gang free (or placed spare)."""
        ...


class FixedScaling:
    """A job with a fixed parallel.dp never resizes by itself."""

    def decide(self, plan: Plan, free_groups: int) -> NoopDecision | ResizeDecision:
        return NoopDecision("fixed size")


class ElasticScaling:
    """parallel.dp = {min, max}: grow into the groups that are free (bundles of a lost node Ray placed again
    count too), to the largest size the rules allow."""

    def decide(self, plan: Plan, free_groups: int) -> NoopDecision | ResizeDecision:
        size = largest_size(plan, plan.dp + free_groups // plan.pp)
        if size is not None and size > plan.dp:
            return ResizeDecision(size, "resources appeared")
        return NoopDecision(f"no room to grow past dp={plan.dp}")


def scaling_policy(plan: Plan) -> ScalingPolicy:
    return ElasticScaling() if plan.dp_range is not None else FixedScaling()
