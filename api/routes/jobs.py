"""`/api/jobs`: submit a job, list the caller's, and each job's status, metrics, logs, model, trackers, events,
resize, fault drills, stop and delete (only its owner's or an admin's: another user's job answers as a missing
one)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from trainyard.api.body import JsonBodyRoute
from trainyard.api.deps import CALIBRATING, GUARDED, NOT_FOUND, OWNED, Manager, caller, read_spec
from trainyard.api.models import FaultDrill, JobCreated, JobInfo, JobLogs, ScaleRequest, job_info
from trainyard.api.spec import RawSpec
from trainyard.parallel.config import MAX_DEGREE, MAX_STEPS
from trainyard.parallel.runtime.step.step_row import MetricsRow
from trainyard.service.tenancy.users import User

MAX_LOG_TAIL = 100_000
"""Most lines per rank one logs request returns."""

router = APIRouter(route_class=JsonBodyRoute, tags=["jobs"])


@router.post("/api/jobs", status_code=201, dependencies=GUARDED,
          responses={429: {"description": "the queue is full (`trainyard serve --max-queued`)"}, **CALIBRATING})
def submit(manager: Manager, spec: Annotated[RawSpec, Body()], user: User = Depends(caller)) -> JobCreated:
    """Validate the spec and queue the job (PENDING), owned by the caller; it starts when the whole job's
    resources are free and within the caller's quota (a job beyond the whole quota is a 422 on `resources`).
    Every path it names must be the caller's to read (their data roots, uploads and jobs' outputs)."""
    return JobCreated(job_id=manager.submit(read_spec(manager, spec, user), user))

@router.get("/api/jobs")
def list_jobs(manager: Manager, user: User = Depends(caller)) -> list[JobInfo]:
    """The caller's jobs (an admin's: every job)."""
    queue = manager.queue_view()
    jobs = manager.list(None if user.admin else user.name)
    return [job_info(j, manager.dashboard_url, queue, with_spec=False) for j in jobs]

@router.get("/api/jobs/{job_id}", dependencies=OWNED, responses=NOT_FOUND)
def job(manager: Manager, job_id: str) -> JobInfo:
    return job_info(manager.get(job_id), manager.dashboard_url, manager.queue_view())

@router.get("/api/jobs/{job_id}/metrics", dependencies=OWNED, responses=NOT_FOUND,
            response_model=list[MetricsRow])  # type: ignore[valid-type]  # a model made from StepRow
def metrics(manager: Manager, job_id: str, since: int = Query(0, ge=0, le=MAX_STEPS,
                                             description="first step to return")) -> list[dict]:
    return manager.metrics(job_id, since)

@router.get("/api/jobs/{job_id}/logs", dependencies=OWNED,
         responses={**NOT_FOUND, 404: {"description": "no such job, or no such rank in it"},
                    409: {"description": "the job has not started its workers (it has no ranks yet)"}})
def logs(manager: Manager, job_id: str,
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

@router.get("/api/jobs/{job_id}/model", dependencies=OWNED, response_class=FileResponse,
         responses={**NOT_FOUND, 200: {"content": {"application/octet-stream": {}, "application/x-tar": {}},
                          "description": "format=trainyard: the final weights as one safetensors file; "
                                         "`__metadata__` holds `config` (the model config, JSON) and `step`. "
                                         "format=hf: a tar of a Hugging Face directory (config.json, "
                                         "safetensors, generation_config.json, the tokenizer). "
                                         "format=peft: a tar of a LoRA job's PEFT adapter directory "
                                         "(adapter_config.json, adapter_model.safetensors)"},
                    409: {"description": "the job has not ended SUCCEEDED or STOPPED, or wrote no model"},
                    422: {"description": "format=hf: a model Hugging Face has no form for; format=peft: no "
                                         "LoRA adapters, or ones PEFT has no form for"}})
def model(manager: Manager, job_id: str, format: Literal["trainyard", "hf", "peft"] = Query(  # noqa: A002 - the query's name
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

@router.get("/api/jobs/{job_id}/tracking", dependencies=OWNED, responses=NOT_FOUND)
def tracking(manager: Manager, job_id: str) -> dict[str, str]:
    """Where the job's experiment trackers write (the spec's `tracking`): `tensorboard` (a logdir), `wandb`
    (the directory of its W&B runs), `mlflow` (the tracking URI); empty when it asks for none."""
    return manager.tracking(job_id)

@router.get("/api/jobs/{job_id}/events", dependencies=OWNED, responses=NOT_FOUND)
def events(manager: Manager, job_id: str) -> list[dict]:
    """What happened to the job as it ran, oldest first: `failure` (cause, ranks, nodes, step, steps_lost,
    restore_step), `recovered` (recovery_s: from the failure to the next finished step), `checkpoint`."""
    return manager.events(job_id)

@router.post("/api/jobs/{job_id}/scale", dependencies=OWNED, status_code=202,
          responses={**NOT_FOUND,
                     409: {"description": "the job is not RUNNING, or the resources for more ranks are not free"},
                     422: {"description": "a size the job cannot take (range, global batch, cluster)"}})
def scale(manager: Manager, job_id: str, request: ScaleRequest) -> dict:
    """Resize a running job's data parallelism at its next step boundary (the job is RESIZING meanwhile)."""
    return manager.scale(job_id, request.dp)

@router.post("/api/jobs/{job_id}/faults", dependencies=OWNED, status_code=202,
          responses={403: {"description": "fault drills are off (`trainyard serve --allow-fault-injection`)"},
                     409: {"description": "the job is not RUNNING"}})
def fault(manager: Manager, job_id: str, drill: FaultDrill, http: Request) -> dict:
    """Schedule a fault drill in a running job."""
    if not http.app.state.allow_fault_injection:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "fault drills are off; start the service with "
                                                       "`trainyard serve --allow-fault-injection`")
    return manager.inject_fault(job_id, drill.kind, drill.rank, drill.at_step, drill.factor)

@router.post("/api/jobs/{job_id}/stop", dependencies=OWNED, responses=NOT_FOUND)
def stop(manager: Manager, job_id: str) -> JobInfo:
    return job_info(manager.stop(job_id), manager.dashboard_url, {})

@router.delete("/api/jobs/{job_id}", status_code=204, dependencies=OWNED, responses=NOT_FOUND)
def delete(manager: Manager, job_id: str) -> None:
    manager.delete(job_id)
