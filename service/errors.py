"""Errors of the job manager that the API maps to HTTP statuses (404, 409, 429). No Ray import here, so
the API can register its handlers without loading the manager."""


class JobNotFound(KeyError):
    """No job with this id (never submitted, or deleted)."""


class RankNotFound(LookupError):
    """The job has no rank with this number."""


class JobConflict(RuntimeError):
    """The request does not fit the job's state (e.g. deleting a running job)."""


class QueueFull(RuntimeError):
    """The queue holds as many waiting jobs as the service allows (`trainyard serve --max-queued`)."""
