"""The REST API: FastAPI routes over a JobManager, bearer-token auth, and error mapping.

Every error a user can fix is a 422 in FastAPI's own shape (`detail: [{loc, msg, type}]`), whether
pydantic found it (types, ranges, unknown fields) or the plan did (cross-field rules, dataset, cluster
fit), so clients parse one format. Nothing is created for an invalid spec. The API never touches Ray or
torch itself: it calls the manager it is given.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.models import ClusterInfo, JobCreated, JobInfo, MetricsRow, job_info
from api.spec import describe_error
from parallel.config import JobConfig, RuleError
from parallel.plan import describe

if TYPE_CHECKING:
    from service.manager import JobManager

_bearer = HTTPBearer(auto_error=False)


def create_app(manager: JobManager, token: str, ray_address: str | None = None) -> FastAPI:
    app = FastAPI(title="trainyard", version="0.1.0",
                  description="Submit GPT training jobs and follow them as they train on Ray.")

    def authorized(creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        if creds is None or not secrets.compare_digest(creds.credentials, token):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token "
                                "(it is in the state directory's `token` file)",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def _invalid_spec(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = []
        for err in exc.errors():
            field, msg = describe_error(err)
            detail.append({"loc": list(err["loc"]), "field": field, "msg": msg, "type": err["type"]})
        return JSONResponse(status_code=422, content={"detail": detail})

    @app.exception_handler(RuleError)
    async def _rule_broken(_: Request, exc: RuleError) -> JSONResponse:
        loc = ["body", *exc.field.split(".")]
        detail = [{"loc": loc, "field": exc.field, "msg": exc.message, "type": "rule"}]
        return JSONResponse(status_code=422, content={"detail": detail})

    def get_job(job_id: str) -> Any:
        from service.manager import JobNotFound  # service is importable without Ray starting

        try:
            return manager.get(job_id)
        except JobNotFound:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}") from None

    guarded = [Depends(authorized)]

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.post("/api/jobs", status_code=201, dependencies=guarded)
    def submit(spec: JobConfig) -> JobCreated:
        return JobCreated(job_id=manager.submit(spec))

    @app.get("/api/jobs", dependencies=guarded)
    def list_jobs() -> list[JobInfo]:
        return [job_info(j, manager.dashboard_url, with_spec=False) for j in manager.list()]

    @app.get("/api/jobs/{job_id}", dependencies=guarded)
    def job(job_id: str) -> JobInfo:
        return job_info(get_job(job_id), manager.dashboard_url)

    @app.get("/api/jobs/{job_id}/metrics", dependencies=guarded)
    def metrics(job_id: str, since: int = 0) -> list[MetricsRow]:
        get_job(job_id)
        return [MetricsRow(**row) for row in manager.metrics(job_id, since)]

    @app.post("/api/jobs/{job_id}/stop", dependencies=guarded)
    def stop(job_id: str) -> JobInfo:
        get_job(job_id)
        return job_info(manager.stop(job_id), manager.dashboard_url)

    @app.delete("/api/jobs/{job_id}", status_code=204, dependencies=guarded)
    def delete(job_id: str) -> None:
        from service.manager import JobConflict

        get_job(job_id)
        try:
            manager.delete(job_id)
        except JobConflict as e:
            raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from None

    @app.post("/api/plans", dependencies=guarded)
    def plan(spec: JobConfig) -> dict:
        """Validate a spec and return its plan with the resources it needs vs the cluster's; creates nothing."""
        described = describe(manager.plan(spec))
        cluster = manager.cluster()
        described["resources"]["available"] = {"CPU": cluster.cpus, "GPU": cluster.gpus,
                                               "nodes": len(cluster.nodes)}
        return described

    @app.get("/api/cluster", dependencies=guarded)
    def cluster() -> ClusterInfo:
        c = manager.cluster()
        return ClusterInfo(nodes=len(c.nodes), cpus=c.cpus, gpus=c.gpus, ray_address=ray_address,
                           dashboard_url=manager.dashboard_url)

    return app
