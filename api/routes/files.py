"""`/api/files`: a user's uploads (`service.tenancy.uploads`), the files and prepared dataset directories their specs
may name. The body of an upload is streamed to disk (never held in memory), up to the per-upload limit (the app's
`state.max_upload_bytes`, which `api.guard` applies to this route's body) or what the user's storage quota leaves (a 413
past it, nothing kept); a directory is sent as a tar (`archive=tar`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from trainyard.api.body import JsonBodyRoute
from trainyard.api.deps import Manager, caller
from trainyard.service.tenancy.uploads import UploadNotFound, UploadTooLarge
from trainyard.service.tenancy.users import User


class UploadInfo(BaseModel):
    upload_id: str
    name: str
    path: str
    """What a spec names: `data.path`, `data.sources[].path`, `init_from.hf`, ..."""
    kind: Literal["file", "directory"]
    bytes: int
    created_at: float


router = APIRouter(prefix="/api/files", tags=["files"], route_class=JsonBodyRoute)
UPLOAD_PATH = "/api/files"


@router.post("", status_code=201,
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
             responses={409: {"description": "the user's storage quota is used up"},
                        413: {"description": "larger than one upload may be, or than the storage quota leaves"}})
async def upload(request: Request, manager: Manager, user: User = Depends(caller),
                 name: str = Query(..., min_length=1, max_length=128,
                                   description="the file's (or directory's) name in the upload"),
                 archive: Literal["none", "tar"] = Query("none", description="tar: the body is a tar of a "
                                                                            "directory, extracted")) -> UploadInfo:
    """Upload a file (the body's bytes) or a directory (a tar of it, `archive=tar`); the answer's `path` is
    what a spec names."""
    limit = await run_in_threadpool(manager.tenancy.upload_limit, user, request.app.state.max_upload_bytes)
    try:
        upload = await manager.tenancy.uploads.receive(user.name, name, request.stream(), limit, archive == "tar")
    except UploadTooLarge as e:
        raise HTTPException(413, str(e)) from None
    return UploadInfo(**asdict(upload))


@router.get("")
def list_uploads(manager: Manager, user: User = Depends(caller)) -> list[UploadInfo]:
    """The caller's uploads, oldest first."""
    return [UploadInfo(**asdict(u)) for u in manager.tenancy.uploads.list(user.name)]


@router.delete("/{upload_id}", status_code=204, responses={404: {"description": "no such upload of yours"}})
def delete_upload(upload_id: str, manager: Manager, user: User = Depends(caller)) -> None:
    """Delete one of the caller's uploads (a job still queued that names it then fails to read it)."""
    try:
        manager.tenancy.uploads.delete(user.name, upload_id)
    except UploadNotFound:
        raise HTTPException(404, f"no upload {upload_id}") from None
