"""The failure policies by name. A new policy is a module of this package with a `make(plan) -> FailurePolicy`,
and one line in `POLICIES` (the name it goes by, its `make`)."""

from __future__ import annotations

from collections.abc import Callable

from trainyard.actors.failure_handling import default
from trainyard.actors.failure_handling.policy import FailurePolicy
from trainyard.parallel.plan import Plan

POLICIES: dict[str, Callable[[Plan], FailurePolicy]] = {
    "default": default.make,
}
"""Each failure policy's name -> how a job's is made from its plan."""

DEFAULT = "default"


def failure_policy(plan: Plan, name: str = DEFAULT) -> FailurePolicy:
    """The job's failure policy: the one `name` names, made from the job's plan."""
    try:
        make = POLICIES[name]
    except KeyError:
        raise ValueError(f"no failure policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return make(plan)
