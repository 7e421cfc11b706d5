"""The REST API's app: FastAPI over a JobManager, its resources one router each (`api.routes`), bearer-token auth
before anything of a request is read (`api.guard`), and error mapping (`api.errors`).

Each request carries a user's bearer token: the state directory's `token` is the admin's, the others are made by
`trainyard token create` (`service.tenancy.users`). A job belongs to its submitter: a user lists only their own jobs,
and another user's job answers as one that does not exist (a 404) on every route that names it (`api.deps`); an admin
sees and controls every job. Every path a spec names is resolved against the caller before the spec is read
(`service.tenancy.requests`, `service.tenancy.access`). Nothing is created for an invalid spec. The API never touches
Ray or torch itself: it calls the manager it is given (`app.state.manager`).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from fastapi import FastAPI
from trainyard.api import errors
from trainyard.api.guard import Authenticate
from trainyard.api.routes import ROUTERS
from trainyard.api.routes.files import UPLOAD_PATH
from trainyard.service.tenancy.uploads import DEFAULT_MAX_UPLOAD_BYTES
from trainyard.service.tenancy.users import ADMIN_USER, Registry, User

if TYPE_CHECKING:
    from trainyard.service.manager import JobManager


def create_app(manager: JobManager, token: str, ray_address: str | None = None,
               allow_fault_injection: bool = False, users: Registry | None = None,
               max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES) -> FastAPI:
    """`token`: the admin's; `users`: the other users' tokens (none without); `max_upload_bytes`: one upload's."""
    app = FastAPI(title="trainyard", version="0.1.0",
                  description="Submit GPT training jobs and follow them as they train on Ray.")
    app.state.manager, app.state.ray_address = manager, ray_address
    app.state.allow_fault_injection, app.state.max_upload_bytes = allow_fault_injection, max_upload_bytes
    registry = users or Registry(None)

    def authenticate(presented: str) -> User | None:
        # As bytes: compare_digest raises TypeError on a str with non-ASCII characters (a 500, not a 401).
        if secrets.compare_digest(presented.encode(), token.encode()):
            return ADMIN_USER
        return registry.authenticate(presented)

    app.add_middleware(Authenticate, authenticate=authenticate, streamed={UPLOAD_PATH: max_upload_bytes})
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
