"""What the routes depend on: the request's manager (`app.state.manager`), the caller (authenticated by `api.guard`
before the route ran), the rule of every route that names a job (its owner or an admin; another user's job answers
as a missing one), and reading a submitted spec (its paths resolved against the caller first)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from trainyard.api.guard import UNAUTHORIZED
from trainyard.api.spec import validate_submitted
from trainyard.parallel.config import JobConfig
from trainyard.service.errors import JobNotFound
from trainyard.service.tenancy.users import User

_bearer = HTTPBearer(auto_error=False)


def manager_of(request: Request) -> Any:
    """The app's `JobManager` (typed Any: the API imports no Ray, which the manager's module does)."""
    return request.app.state.manager


Manager = Annotated[Any, Depends(manager_of)]


def caller(request: Request, _: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> User:
    """The request's user, authenticated by `api.guard` before the route ran (`_bearer`: the docs' scheme)."""
    user = getattr(request.state, "user", None)
    if user is None:  # a route the guard leaves open never asks
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
    return user


Caller = Annotated[User, Depends(caller)]


def owner_or_admin(job_id: str, manager: Manager, user: Caller) -> None:
    """The rule of every route that names a job: only its owner or an admin. Another user's job answers as one
    that does not exist (a 404, the same text)."""
    if not user.admin and manager.get(job_id).owner != user.name:
        raise JobNotFound(job_id)


GUARDED = [Depends(caller)]
OWNED = [Depends(owner_or_admin)]
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "no such job (another user's job answers the same)"}}
CALIBRATING: dict[int | str, dict[str, Any]] = {503: {
    "description": "`parallel: auto`: this node type's costs are being measured; retry after the Retry-After "
                   "header's seconds"}}


def read_spec(manager: Any, spec: Any, user: User) -> JobConfig:
    """A body's spec, its paths and jobs resolved against the caller first (`Tenancy.confine`), then read."""
    return validate_submitted(manager.tenancy.confine(spec, user))
