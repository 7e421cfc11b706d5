"""How every route reads a JSON body: a body that is not JSON (not UTF-8, nested too deeply, an integer of too many
digits) is a 422 naming `body` like any other bad input, not FastAPI's 400 naming nothing."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute


class _JsonBody(Request):
    """A request whose body, if it cannot be read as JSON, is a JSON error like any other: FastAPI makes a 400
    ("There was an error parsing the body") of anything json.loads raises but a JSONDecodeError: what bytes that
    are not UTF-8 and arrays or objects nested deeper than Python's recursion limit raise (and an integer of too
    many digits, see `_parse_int`)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = json.loads(body, parse_int=_parse_int)
            except UnicodeDecodeError as e:
                text = body[:e.start].decode(e.encoding, "replace")
                raise json.JSONDecodeError(f"not {e.encoding} text ({e.reason})", text, len(text)) from None
            except RecursionError:
                raise json.JSONDecodeError("arrays or objects nested too deeply", "", 0) from None
        return self._json


def _parse_int(text: str) -> int | float:
    """A JSON integer; one of more digits than Python converts (4300) is read as a float, which is inf, and so
    refused as any other non-finite number is, naming its field (int() raises, a 400 naming nothing)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


class JsonBodyRoute(APIRoute):
    """Every route's body is read by `_JsonBody` (each router is made with it: `APIRouter(route_class=...)`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_json_body(request: Request) -> Response:
            return await handler(_JsonBody(request.scope, request.receive))

        return with_json_body
