"""The REST API: FastAPI routes over a JobManager, bearer-token auth, users, and error mapping.

Each request carries a user's bearer token, checked before anything of the request is read (`api.guard`): the
state directory's `token` is the admin's, the others are made by `trainyard token create` (`service.users`). A
job belongs to its submitter: a user lists only their own jobs, and another user's job answers as one that does
not exist (a 404) on every route that names it; an admin sees and controls every job. Every path a spec names is
resolved against the caller before the spec is read (`JobManager.confine`, `service.access`). Uploads are
`api.files`'s.

Every error a user can fix is a 422 in FastAPI's own shape (`detail: [{loc, msg, type}]`), whether
pydantic found it (types, ranges, unknown fields) or the plan did (cross-field rules, dataset, cluster
fit), so clients parse one format. Nothing is created for an invalid spec. The API never touches Ray or
torch itself: it calls the manager it is given.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from trainyard.api.files import files_router
from trainyard.api.guard import UNAUTHORIZED, Authenticate
from trainyard.api.models import (
    ClusterInfo,
    FaultDrill,
    JobCreated,
    JobInfo,
    JobLogs,
    MetricsRow,
    ScaleRequest,
    job_info,
)
from trainyard.api.spec import RawSpec, validate_submitted
from trainyard.parallel.config import MAX_DEGREE, MAX_STEPS, JobConfig, RuleError
from trainyard.parallel.plan.present import describe
from trainyard.parallel.spec import describe_error, relevant_errors
from trainyard.service.errors import Calibrating, JobConflict, JobNotFound, QueueFull, RankNotFound
from trainyard.service.uploads import DEFAULT_MAX_UPLOAD_BYTES
from trainyard.service.users import ADMIN_USER, Registry, User

if TYPE_CHECKING:
    from trainyard.service.manager import JobManager

_bearer = HTTPBearer(auto_error=False)
MAX_LOG_TAIL = 100_000
"""Most lines per rank one logs request returns."""


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


class _JsonBodyRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_json_body(request: Request) -> Response:
            return await handler(_JsonBody(request.scope, request.receive))

        return with_json_body


def create_app(manager: JobManager, token: str, ray_address: str | None = None,
               allow_fault_injection: bool = False, users: Registry | None = None,
               max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES) -> FastAPI:
    """`token`: the admin's; `users`: the other users' tokens (none without); `max_upload_bytes`: one upload's."""
    app = FastAPI(title="trainyard", version="0.1.0",
                  description="Submit GPT training jobs and follow them as they train on Ray.")
    app.router.route_class = _JsonBodyRoute  # before any route is added: every body is read by _JsonBody
    registry = users or Registry(None)

    def authenticate(presented: str) -> User | None:
        # As bytes: compare_digest raises TypeError on a str with non-ASCII characters (a 500, not a 401).
        if secrets.compare_digest(presented.encode(), token.encode()):
            return ADMIN_USER
        return registry.authenticate(presented)

    app.add_middleware(Authenticate, authenticate=authenticate)  # before any body is read (`api.guard`)

    def caller(request: Request, _: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> User:
        """The request's user, authenticated by `api.guard` before the route ran (`_bearer`: the docs' scheme)."""
        user = getattr(request.state, "user", None)
        if user is None:  # a route the guard leaves open never asks
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
        return user

    def owner_or_admin(job_id: str, user: User = Depends(caller)) -> None:
        """The rule of every route that names a job: only its owner or an admin. Another user's job answers as
        one that does not exist (a 404, the same text)."""
        if not user.admin and manager.get(job_id).owner != user.name:
            raise JobNotFound(job_id)

    @app.exception_handler(RequestValidationError)
    async def _invalid_spec(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = []
        for err in relevant_errors(exc.errors()):
            field, msg = describe_error(err)
            loc = ["body", *field.split(".")] if err["type"] == "rule" else list(err["loc"])
            detail.append({"loc": loc, "field": field, "msg": msg, "type": err["type"]})
        return JSONResponse(status_code=422, content={"detail": detail})

    @app.exception_handler(RuleError)
    async def _rule_broken(_: Request, exc: RuleError) -> JSONResponse:
        loc = ["body", *exc.field.split(".")]
        detail = [{"loc": loc, "field": exc.field, "msg": exc.message, "type": "rule"}]
        return JSONResponse(status_code=422, content={"detail": detail})

    # The manager's own errors, wherever a handler meets them (a job deleted by a concurrent request is
    # a 404 at any point of a stop or delete, never a 500).
    @app.exception_handler(JobNotFound)
    async def _not_found(_: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": f"no job {exc.args[0]}"})

    @app.exception_handler(RankNotFound)
    async def _no_rank(_: Request, exc: RankNotFound) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": str(exc)})

    @app.exception_handler(JobConflict)
    async def _conflict(_: Request, exc: JobConflict) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": str(exc)})

    @app.exception_handler(QueueFull)
    async def _queue_full(_: Request, exc: QueueFull) -> JSONResponse:
        return JSONResponse(status_code=429, content={"detail": str(exc)})

    @app.exception_handler(Calibrating)
    async def _calibrating(_: Request, exc: Calibrating) -> JSONResponse:
        return JSONResponse(status_code=503, content={"detail": str(exc)},
                            headers={"Retry-After": str(exc.retry_after_s)})

    guarded = [Depends(caller)]
    owned = [Depends(owner_or_admin)]
    others: dict[int | str, dict[str, Any]] = {
        404: {"description": "no such job (another user's job answers the same)"}}

    def read_spec(spec: Any, user: User) -> JobConfig:
        """A body's spec, its paths and jobs resolved against the caller first (`JobManager.confine`)."""
        return validate_submitted(manager.confine(spec, user))

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    calibrating: dict[int | str, dict[str, Any]] = {503: {
        "description": "`parallel: auto`: this node type's costs are being measured; retry after the Retry-After "
                       "header's seconds"}}

    @app.post("/api/jobs", status_code=201, dependencies=guarded,
              responses={429: {"description": "the queue is full (`trainyard serve --max-queued`)"}, **calibrating})
    def submit(spec: Annotated[RawSpec, Body()], user: User = Depends(caller)) -> JobCreated:
        """Validate the spec and queue the job (PENDING), owned by the caller; it starts when the whole job's
        resources are free and within the caller's quota (a job beyond the whole quota is a 422 on `resources`).
        Every path it names must be the caller's to read (their data roots, uploads and jobs' outputs)."""
        return JobCreated(job_id=manager.submit(read_spec(spec, user), user))

    @app.get("/api/jobs")
    def list_jobs(user: User = Depends(caller)) -> list[JobInfo]:
        """The caller's jobs (an admin's: every job)."""
        queue = manager.queue_view()
        jobs = manager.list(None if user.admin else user.name)
        return [job_info(j, manager.dashboard_url, queue, with_spec=False) for j in jobs]

    @app.get("/api/jobs/{job_id}", dependencies=owned, responses=others)
    def job(job_id: str) -> JobInfo:
        return job_info(manager.get(job_id), manager.dashboard_url, manager.queue_view())

    @app.get("/api/jobs/{job_id}/metrics", dependencies=owned, responses=others)
    def metrics(job_id: str, since: int = Query(0, ge=0, le=MAX_STEPS,
                                                 description="first step to return")) -> list[MetricsRow]:
        return [MetricsRow(**row) for row in manager.metrics(job_id, since)]

    @app.get("/api/jobs/{job_id}/logs", dependencies=owned,
             responses={**others, 404: {"description": "no such job, or no such rank in it"},
                        409: {"description": "the job has not started its workers (it has no ranks yet)"}})
    def logs(job_id: str,
             rank: int | None = Query(None, ge=0, le=MAX_DEGREE**3, description="one rank (default: every rank)"),
             tail: int = Query(1000, ge=1, le=MAX_LOG_TAIL, description="at most this many lines per rank, the last"),
             since: int | None = Query(None, ge=0, le=2**53,
                                       description="only lines from this line on: a previous answer's `next` "
                                                   "(needs `rank`)"),
             stream: Literal["stderr", "stdout"] = Query("stderr", description="the ranks' stderr or stdout"),
             ) -> JobLogs:
        """Each rank's log, read from Ray (also after the job ended, while Ray still holds it)."""
        if since is not None and rank is None:
            raise RequestValidationError([{"loc": ("query", "since"), "type": "value_error",
                                           "msg": "since counts the lines of one rank's log: give `rank` too"}])
        return JobLogs(**manager.logs(job_id, rank, stream, tail, since))

    @app.get("/api/jobs/{job_id}/model", dependencies=owned, response_class=FileResponse,
             responses={**others, 200: {"content": {"application/octet-stream": {}, "application/x-tar": {}},
                              "description": "format=trainyard: the final weights as one safetensors file; "
                                             "`__metadata__` holds `config` (the model config, JSON) and `step`. "
                                             "format=hf: a tar of a Hugging Face directory (config.json, "
                                             "safetensors, generation_config.json, the tokenizer). "
                                             "format=peft: a tar of a LoRA job's PEFT adapter directory "
                                             "(adapter_config.json, adapter_model.safetensors)"},
                        409: {"description": "the job has not ended SUCCEEDED or STOPPED, or wrote no model"},
                        422: {"description": "format=hf: a model Hugging Face has no form for; format=peft: no "
                                             "LoRA adapters, or ones PEFT has no form for"}})
    def model(job_id: str, format: Literal["trainyard", "hf", "peft"] = Query(  # noqa: A002 - the query's name
            "trainyard", description="trainyard: one safetensors file; hf: a Hugging Face directory as a tar (a "
                                     "LoRA job's merged model); peft: a LoRA job's PEFT adapter directory as a tar")
              ) -> FileResponse:
        """The trained model of an ended job, consolidated from its final checkpoint whatever its layout."""
        path = manager.model_file(job_id)
        if format in ("hf", "peft"):
            from trainyard.service.hf_export import hf_archive  # torch: only when asked for

            return FileResponse(hf_archive(path, manager.get(job_id).spec, format), media_type="application/x-tar",
                                filename=f"{job_id}-{format}.tar")
        return FileResponse(path, media_type="application/octet-stream", filename=f"{job_id}.safetensors")

    @app.get("/api/jobs/{job_id}/tracking", dependencies=owned, responses=others)
    def tracking(job_id: str) -> dict[str, str]:
        """Where the job's experiment trackers write (the spec's `tracking`): `tensorboard` (a logdir), `wandb`
        (the directory of its W&B runs), `mlflow` (the tracking URI); empty when it asks for none."""
        return manager.tracking(job_id)

    @app.get("/api/jobs/{job_id}/events", dependencies=owned, responses=others)
    def events(job_id: str) -> list[dict]:
        """What happened to the job as it ran, oldest first: `failure` (cause, ranks, nodes, step, steps_lost,
        restore_step), `recovered` (recovery_s: from the failure to the next finished step), `checkpoint`."""
        return manager.events(job_id)

    @app.post("/api/jobs/{job_id}/scale", dependencies=owned, status_code=202,
              responses={**others,
                         409: {"description": "the job is not RUNNING, or the resources for more ranks are not free"},
                         422: {"description": "a size the job cannot take (range, global batch, cluster)"}})
    def scale(job_id: str, request: ScaleRequest) -> dict:
        """Resize a running job's data parallelism at its next step boundary (the job is RESIZING meanwhile)."""
        return manager.scale(job_id, request.dp)

    @app.post("/api/jobs/{job_id}/faults", dependencies=owned, status_code=202,
              responses={403: {"description": "fault drills are off (`trainyard serve --allow-fault-injection`)"},
                         409: {"description": "the job is not RUNNING"}})
    def fault(job_id: str, drill: FaultDrill) -> dict:
        """Schedule a fault drill in a running job."""
        if not allow_fault_injection:
            raise HTTPException(status.HTTP_403_FORBIDDEN, "fault drills are off; start the service with "
                                                           "`trainyard serve --allow-fault-injection`")
        return manager.inject_fault(job_id, drill.kind, drill.rank, drill.at_step)

    @app.post("/api/jobs/{job_id}/stop", dependencies=owned, responses=others)
    def stop(job_id: str) -> JobInfo:
        return job_info(manager.stop(job_id), manager.dashboard_url, {})

    @app.delete("/api/jobs/{job_id}", status_code=204, dependencies=owned, responses=others)
    def delete(job_id: str) -> None:
        manager.delete(job_id)

    @app.post("/api/plans", dependencies=guarded, responses=calibrating)
    def plan(spec: Annotated[RawSpec, Body()], user: User = Depends(caller)) -> dict:
        """Validate a spec and return its plan with the resources it needs vs the cluster's; creates nothing."""
        spec, ranking = manager.choose_layout(manager.for_user(read_spec(spec, user), user))
        described = describe(manager.plan(spec))
        if ranking is not None:
            described["planner"] = ranking
        cluster = manager.cluster()
        described["resources"]["available"] = {"CPU": cluster.cpus, "GPU": cluster.gpus,
                                               "nodes": len(cluster.nodes)}
        return described

    @app.get("/api/cluster", dependencies=guarded)
    def cluster() -> ClusterInfo:
        c = manager.cluster()
        return ClusterInfo(nodes=len(c.nodes), cpus=c.cpus, gpus=c.gpus, ray_address=ray_address,
                           dashboard_url=manager.dashboard_url)

    app.include_router(files_router(manager, caller, max_upload_bytes))
    return app
