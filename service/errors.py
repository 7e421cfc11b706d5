"""Errors of the job manager that the API maps to HTTP statuses (404, 409, 429, 503). No Ray import here, so
the API can register its handlers without loading the manager."""


class JobNotFound(KeyError):
    """No job with this id (never submitted, or deleted)."""


class RankNotFound(LookupError):
    """The job has no rank with this number."""


class JobConflict(RuntimeError):
    """The request does not fit the job's state (e.g. deleting a running job)."""


class QueueFull(RuntimeError):
    """The queue holds as many waiting jobs as the service allows (`trainyard serve --max-queued`)."""


class Calibrating(RuntimeError):
    """`parallel: auto` needs this node type's measured costs, which are being measured (in the background: a
    request never waits a minute for them); retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClientNotFound(LookupError):
    """No Tinker session, training client or request with this id (another user's answers the same)."""


class CheckpointNotFound(LookupError):
    """No Tinker training run or checkpoint of this user where the request's field (`args[0]`) names one (another
    user's answers the same)."""
