"""Job states and the coordinator's pure transition rule.

The names are Ray Jobs' five plus RECOVERING (a failed step being recovered from the latest checkpoint) and
RESIZING (the job moving to another data-parallel size between two steps).
`next_state` maps the current state and what just happened to the next state; the coordinator applies it
in one place (`_set_state`).
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    PENDING = "PENDING"
    """Waiting for the whole job's placement group (gang admission)."""
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.STOPPED, JobStatus.SUCCEEDED, JobStatus.FAILED)


class Event(StrEnum):
    RESOURCES_READY = "resources_ready"
    FINISHED = "finished"
    STOP_REQUESTED = "stop_requested"
    ERROR = "error"
    FAILURE = "failure"
    """A step failed and the job recovers (its `fault.max_failures` allow it)."""
    RECOVERED = "recovered"
    RESIZE = "resize"
    """The job changes its data-parallel size at a step boundary."""
    RESIZED = "resized"


_TRANSITIONS: dict[tuple[JobStatus, Event], JobStatus] = {
    (JobStatus.PENDING, Event.RESOURCES_READY): JobStatus.RUNNING,
    (JobStatus.RUNNING, Event.FINISHED): JobStatus.SUCCEEDED,
    (JobStatus.RUNNING, Event.FAILURE): JobStatus.RECOVERING,
    (JobStatus.RECOVERING, Event.RECOVERED): JobStatus.RUNNING,
    (JobStatus.RUNNING, Event.RESIZE): JobStatus.RESIZING,
    (JobStatus.RESIZING, Event.RESIZED): JobStatus.RUNNING,
    (JobStatus.RESIZING, Event.FAILURE): JobStatus.RECOVERING,
}


def next_state(state: JobStatus, event: Event) -> JobStatus:
    """The state after `event`. Stop and error end any live state; a terminal state never changes."""
    if state.is_terminal:
        return state
    if event is Event.STOP_REQUESTED:
        return JobStatus.STOPPED
    if event is Event.ERROR:
        return JobStatus.FAILED
    try:
        return _TRANSITIONS[(state, event)]
    except KeyError:
        raise ValueError(f"no transition from {state} on {event}") from None
