"""Nothing is read before the caller is known: an ASGI middleware that authenticates every request from its
`Authorization` header before any route (and so before any body) runs, and answers 401 without reading the body.

The Tinker SDK (`api.routes.tinker`) sends its key as `X-API-Key: tml-<token>` instead: the same token, the same user.
The user it finds is the request's `state.user`, which the routes' `caller` dependency returns. The paths that need
no token are the health check and the API's own documentation. Then, and only for a known user, a body's size is
capped (Starlette's body limit: a declared length over it is a 413 unread, a streamed body is cut off once past
it): `MAX_JSON_BODY` for every route, the upload route its own (`streamed`), streamed to disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.middleware.body_limit import RequestBodyLimitMiddleware

OPEN_PATHS = frozenset({"/healthz", "/api/v1/healthz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
TINKER_KEY_PREFIX = "tml-"
"""The Tinker SDK's API keys (`X-API-Key`) are `tml-` + a trainyard token; the SDK refuses keys without it."""
MAX_JSON_BODY = 1 << 20
"""The largest JSON body a route reads (a JobSpec is a few KiB): larger is a 413, refused unread."""
UNAUTHORIZED = ("missing or wrong bearer token (the admin's is in the state directory's `token` file; `trainyard "
                "token create NAME` makes a user's)")


class Authenticate:
    """ASGI middleware: `authenticate(token)` gives the user of a bearer token, or None (a 401)."""

    def __init__(self, app: Any, authenticate: Callable[[str], Any], streamed: dict[str, int] | None = None):
        """`streamed`: the body limit of each path whose route streams its body (an upload), instead of
        `MAX_JSON_BODY`."""
        self.app = app
        self.authenticate = authenticate
        self.limited = {path: RequestBodyLimitMiddleware(app, limit) for path, limit in (streamed or {}).items()}
        self.json_limited = RequestBodyLimitMiddleware(app, MAX_JSON_BODY)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        user = self._user(scope)
        if user is None:
            body = json.dumps({"detail": UNAUTHORIZED}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        scope.setdefault("state", {})["user"] = user
        await self.limited.get(scope["path"], self.json_limited)(scope, receive, send)

    def _user(self, scope: dict) -> Any:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None:
            key = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"").decode("latin-1").strip()
            return self.authenticate(key.removeprefix(TINKER_KEY_PREFIX)) \
                if key.startswith(TINKER_KEY_PREFIX) and len(key) > len(TINKER_KEY_PREFIX) else None
        scheme, _, credentials = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return None
        return self.authenticate(credentials.strip())
