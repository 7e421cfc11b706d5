"""Error mapping: every error a user can fix is a 422 in FastAPI's own shape (`detail: [{loc, field, msg, type}]`),
whether pydantic found it (types, ranges, unknown fields) or the plan did (cross-field rules, dataset, cluster fit);
the manager's own errors are their status codes (a job deleted by a concurrent request is a 404 at any point of a
stop or delete, never a 500)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from trainyard.parallel.config import RuleError
from trainyard.parallel.spec import describe_error, relevant_errors
from trainyard.service.errors import (
    Calibrating,
    CheckpointNotFound,
    ClientNotFound,
    JobConflict,
    JobNotFound,
    QueueFull,
    RankNotFound,
)
from trainyard.service.tenancy.uploads import UploadTooLarge


async def _invalid_spec(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    detail = []
    for err in relevant_errors(exc.errors()):
        field, msg = describe_error(err)
        loc = ["body", *field.split(".")] if err["type"] == "rule" else list(err["loc"])
        detail.append({"loc": loc, "field": field, "msg": msg, "type": err["type"]})
    return JSONResponse(status_code=422, content={"detail": detail})


async def _rule_broken(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RuleError)
    loc = ["body", *exc.field.split(".")]
    return JSONResponse(status_code=422, content={"detail": [{"loc": loc, "field": exc.field, "msg": exc.message,
                                                              "type": "rule"}]})


async def _not_found(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(status_code=404, content={"detail": f"no job {exc.args[0]}"})


def _not_found_as(text: str):  # noqa: ANN202 - a handler
    async def handler(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": f"{text}: {exc.args[0]}"})

    return handler


async def _no_checkpoint(_: Request, exc: Exception) -> JSONResponse:
    field = exc.args[0]  # the request's field, never what it held
    return JSONResponse(status_code=404, content={"detail": f"no such training run or checkpoint of yours ({field})",
                                                  "field": field})


def _plain(code: int):  # noqa: ANN202 - a handler
    async def handler(_: Request, exc: Exception) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Calibrating) else None
        return JSONResponse(status_code=code, content={"detail": str(exc)}, headers=headers)

    return handler


HANDLERS = {RequestValidationError: _invalid_spec, RuleError: _rule_broken, JobNotFound: _not_found,
            RankNotFound: _plain(404), ClientNotFound: _not_found_as('no such session, model or request'),
            CheckpointNotFound: _no_checkpoint, JobConflict: _plain(409), QueueFull: _plain(429),
            UploadTooLarge: _plain(413), Calibrating: _plain(503)}


def install(app: FastAPI) -> None:
    for error, handler in HANDLERS.items():
        app.add_exception_handler(error, handler)
