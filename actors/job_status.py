"""A job's status as the service shows it: Ray Jobs' five plus RECOVERING and RESIZING. Its own module, importing
nothing: the job store and the command line read it without Ray (`actors.state`, which imports Ray through the
coordinator's calls, re-exports it)."""

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
