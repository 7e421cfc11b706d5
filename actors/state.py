"""The coordinator's states, the outcomes of their actions, and the pure rule `step` that maps a state and
an outcome to the next state (Ray Train v2's controller/state.py).

Each state is a small frozen class that carries its data: RECOVERING the failure and the restore point,
RESIZING the new plan and its reason, STOPPING whether the service is suspending the job. `status` is what
the service shows: Ray Jobs' five plus RECOVERING and RESIZING. The controller runs the action the state
asks for, gets an outcome, and sets `step(state, outcome, inputs)` as the next state, in one place
(`Controller._set_state`). The failure policy's decision is taken here, so a failure in any live state
(running, recovering, resizing, finishing) is handled one way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainyard.actors.calls import Failure
from trainyard.actors.failure_handling.policy import FailureAction, FailureDecision, FailurePolicy
from trainyard.actors.job_status import JobStatus
from trainyard.actors.journal import all_causes
from trainyard.actors.scaling_policy.resize_desk import Resize
from trainyard.parallel.plan import Plan
from trainyard.parallel.plan.cadence import is_done

Point = tuple[str, int]
"""A checkpoint to load: (directory, step)."""


# --- states ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pending:
    status = JobStatus.PENDING


@dataclass(frozen=True)
class Starting:
    """Creating the ranks and loading the resume point (if any)."""

    restore: Point | None
    status = JobStatus.RUNNING


@dataclass(frozen=True)
class Running:
    status = JobStatus.RUNNING


@dataclass(frozen=True)
class Recovering:
    failure: Failure
    restore: Point | None
    """Where the job goes on from: the latest valid checkpoint, else the resume point, else the start."""
    counted: bool = True
    """False: an elastic job riding a lost node (not counted against fault.max_failures)."""
    status = JobStatus.RECOVERING


@dataclass(frozen=True)
class Resizing:
    plan: Plan
    reason: str
    asked: float
    status = JobStatus.RESIZING


@dataclass(frozen=True)
class Finishing:
    """All steps done: the final checkpoint, then the model exported from it."""

    steps_done: int
    saved: bool
    status = JobStatus.RUNNING


@dataclass(frozen=True)
class Stopping:
    """A stop at a step boundary: the final checkpoint, and the model unless `suspend` (the service is going
    down and the job will go on from that checkpoint)."""

    suspend: bool
    steps_done: int
    saved: bool
    status = JobStatus.RUNNING


@dataclass(frozen=True)
class Succeeded:
    status = JobStatus.SUCCEEDED


@dataclass(frozen=True)
class Stopped:
    status = JobStatus.STOPPED


@dataclass(frozen=True)
class Failed:
    error: str
    status = JobStatus.FAILED


State = Pending | Starting | Running | Recovering | Resizing | Finishing | Stopping | Succeeded | Stopped | Failed


def is_terminal(state: State) -> bool:
    return state.status.is_terminal


# --- outcomes of a state's action ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Admitted:
    """Pending: the coordinator is up with its placement group; `restore` is the resume point."""

    restore: Point | None


@dataclass(frozen=True)
class Ready:
    """Starting, Recovering or Resizing: every rank is set up with the job's state."""


@dataclass(frozen=True)
class AtBoundary:
    """Running stopped queuing steps at a step boundary, after `steps_done` steps (`saved`: the last step
    wrote the checkpoint of that point)."""

    steps_done: int
    saved: bool


@dataclass(frozen=True)
class Done:
    """Finishing or Stopping: the final checkpoint (and the model) are written."""

    model: dict | None = None
    """The exported model, {path, step}; None when the service suspends the job (no export)."""


@dataclass(frozen=True)
class CallFailed:
    """A call to the ranks failed; `restore` is the point to go on from, `node_lost` whether a rank that died
    was on a node Ray lost."""

    failure: Failure
    restore: Point | None
    node_lost: bool = False


@dataclass(frozen=True)
class Crashed:
    """An unexpected error in the coordinator itself: the job fails with it."""

    error: str


@dataclass(frozen=True)
class Cancelled:
    """A stop whose grace ran out cancelled the action."""


Outcome = Admitted | Ready | AtBoundary | Done | CallFailed | Crashed | Cancelled


@dataclass(frozen=True)
class Inputs:
    """What the controller knows besides the outcome: requests from outside and the failure budget."""

    steps: int
    """The job's total steps."""
    causes: tuple[str, ...] = ()
    """The failures counted so far."""
    stop: bool = False
    suspend: bool = False
    resize: Resize | None = None
    """A resize the desk accepted, to be taken at this boundary."""
    restarted: Failure | None = None
    """Pending only: Ray restarted this coordinator after its process died (the cause, as a failure)."""


def step(state: State, outcome: Outcome, inputs: Inputs, policy: FailurePolicy) -> State:
    """The state after `outcome`. Pure: the tests feed it scripted outcomes."""
    if is_terminal(state):
        return state
    if isinstance(outcome, Crashed):
        return Failed(outcome.error)
    if isinstance(outcome, Cancelled):
        return Stopped()
    if isinstance(outcome, CallFailed):
        if isinstance(state, Starting) and not outcome.failure.dead:
            # A rank that raised while the job starts (its setup, its checkpoint) would again: not recovered. A rank
            # whose process died (its node lost, say) is the cluster's failure, recovered like any other.
            return Failed(outcome.failure.cause)
        return _on_failure(outcome, inputs, policy)
    match state, outcome:
        case Pending(), Admitted(restore=restore):
            if inputs.restarted is not None:
                # The death came before any stop this incarnation was asked for: it is weighed as the failure it
                # was, not as one while stopping (which fails the job); a stop then ends the job at the step the
                # recovery restores, with its model.
                return _on_failure(CallFailed(inputs.restarted, restore), replace(inputs, stop=False), policy)
            return Starting(restore)
        case Starting() | Recovering() | Resizing(), Ready():
            return Running()
        case Running(), AtBoundary(steps_done=done, saved=saved):
            if inputs.stop:
                return Stopping(inputs.suspend, done, saved)
            if is_done(done, inputs.steps):
                return Finishing(done, saved)
            if inputs.resize is not None:
                return Resizing(inputs.resize.plan, inputs.resize.reason, inputs.resize.asked)
            return Running()
        case Finishing(), Done():
            return Stopped() if inputs.stop else Succeeded()
        case Stopping(), Done():
            return Stopped()
    raise ValueError(f"no transition from {type(state).__name__} on {type(outcome).__name__}")


def failure_decision(outcome: CallFailed, inputs: Inputs, policy: FailurePolicy) -> FailureDecision:
    """The failure policy asked about `outcome`: the one place its arguments are read from what the controller
    knows. `step` acts on it; the controller asks it first only to know whether a point to go on from is needed
    (hashing a checkpoint for a job about to fail is wasted time)."""
    return policy.decide(len(inputs.causes), node_lost=outcome.node_lost, stopping=inputs.stop,
                         out_of_memory=bool(outcome.failure.out_of_memory))


def _on_failure(outcome: CallFailed, inputs: Inputs, policy: FailurePolicy) -> State:
    decision = failure_decision(outcome, inputs, policy)
    if decision.action is FailureAction.RIDE:
        return Recovering(outcome.failure, outcome.restore, counted=False)
    if decision.action is FailureAction.RAISE:
        return Failed(all_causes([*inputs.causes, outcome.failure.cause]))
    return Recovering(outcome.failure, outcome.restore)
