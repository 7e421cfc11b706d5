"""The default failure policy: `fault.max_failures` failures are recovered from, the next ends the job; an elastic
job rides a lost node without counting it; a stopping job and a rank out of memory are not retried."""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.actors.failure_handling.policy import FailureAction, FailureDecision
from trainyard.parallel.plan import Plan


@dataclass(frozen=True)
class DefaultFailurePolicy:
    max_failures: int
    elastic: bool

    def decide(self, counted_before: int, *, node_lost: bool, stopping: bool,
               out_of_memory: bool = False) -> FailureDecision:
        """What to do about a failure, given the failures already counted. A failure while recovering or
        resizing is one like any other: it counts, and the job goes on while the budget allows. A rank that ran
        out of memory would again at the same layout and step: that ends the job, whatever the budget."""
        if self.elastic and node_lost and not stopping:
            return FailureDecision(FailureAction.RIDE, "an elastic job lost a node: ride it (not counted)")
        if stopping:
            return FailureDecision(FailureAction.RAISE, "the job was stopping")
        if out_of_memory:
            return FailureDecision(FailureAction.RAISE, "a rank ran out of memory: the same layout would again")
        if counted_before + 1 > self.max_failures:
            return FailureDecision(FailureAction.RAISE, f"failure {counted_before + 1} is more than "
                                                        f"fault.max_failures={self.max_failures}")
        return FailureDecision(FailureAction.RECOVER, f"failure {counted_before + 1} of "
                                                      f"fault.max_failures={self.max_failures}")


def make(plan: Plan) -> DefaultFailurePolicy:
    """The job's, from its spec (`fault.max_failures`) and whether it is elastic."""
    return DefaultFailurePolicy(plan.config.fault.max_failures, elastic=plan.dp_range is not None)
