"""The Tinker-compatible API's saved state (`/api/v1/...`), the routes the official SDK calls for
`TrainingClient.save_state` (`save_weights`), `load_state[_with_optimizer]` and
`ServiceClient.create_training_client_from_state[_with_optimizer]` (`load_weights`, the latter naming a session),
and `RestClient`'s training runs and checkpoints (`training_runs`, `checkpoints`, `weights_info`, a checkpoint's
delete); and trainyard's own: a checkpoint's adapters as a tar of a PEFT adapter directory
(`.../checkpoints/{checkpoint_id}/peft`).

Every run id and `tinker://` path is the caller's (`service.tenancy.tinker_paths`): another user's answers as a
missing one (a 404 naming the field); a path or name that cannot be one is a 422 naming the field; neither quotes
what was sent. Saves and loads return a future (`retrieve_future`, `api.routes.tinker`). The work is the manager's
`tinker.state` (`service.tinker.state.TinkerState`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from trainyard.api.deps import Caller, Manager
from trainyard.api.routes.tinker import _field_error, layout_error, queued, requested_layout

router = APIRouter(prefix="/api/v1", tags=["tinker"])
"""The `user_metadata` key that asks for a layout (trainyard's extension, as at `create_model`)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SaveWeightsBody(_Body):
    model_id: str = Field(max_length=200)
    path: str | None = Field(default=None, max_length=200)
    """The checkpoint's name (a new one when absent)."""
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = Field(default=None, max_length=64)


class LoadWeightsBody(_Body):
    path: str = Field(max_length=1000)
    optimizer: bool = False
    model_id: str | None = Field(default=None, max_length=200)
    """A live client to load into (the SDK's deprecated `load_state*`)."""
    session_id: str | None = Field(default=None, max_length=200)
    """A new client of this session, made from the checkpoint (`create_training_client_from_state*`)."""
    model_seq_id: int | None = Field(default=None, ge=0, le=1_000_000)
    base_model: str | None = Field(default=None, min_length=1, max_length=4096)
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None
    weights_access_token: str | None = Field(default=None, max_length=4096)


class WeightsInfoBody(_Body):
    tinker_path: str = Field(max_length=1000)


@router.post("/save_weights")
def save_weights(body: SaveWeightsBody, manager: Manager, user: Caller) -> dict[str, Any]:
    return queued(manager.tinker.state.save(user, body.model_id, body.path, body.ttl_seconds, body.overwrite,
                                            body.user_metadata), body.model_id)


@router.post("/load_weights")
def load_weights(body: LoadWeightsBody, manager: Manager, user: Caller) -> Any:
    if body.weights_access_token is not None:
        return _field_error("weights_access_token", "loading another account's checkpoints is not served")
    if body.optimizer_config is not None and body.optimizer_config.get("type") != "adamw":
        return _field_error("optimizer_config", "only Adam (type adamw) is served yet")
    state = manager.tinker.state
    if body.session_id is None:
        if body.model_id is None:
            return _field_error("model_id", "give the model to load into, or session_id for a new one")
        return queued(state.load(user, body.model_id, body.path, body.optimizer), body.model_id)
    if body.model_id is not None or body.model_seq_id is None:
        return _field_error("model_seq_id", "a new client from a checkpoint names its session and model_seq_id "
                                            "(and no model_id)")
    parallel = requested_layout(body.user_metadata)
    if isinstance(parallel, JSONResponse):
        return parallel
    from trainyard.parallel.config import RuleError

    try:
        model_id, request_id = state.create_from(user, body.session_id, body.model_seq_id, body.path,
                                                 body.optimizer, body.base_model, parallel)
    except RuleError as e:
        if not e.field.startswith("parallel"):
            raise
        return layout_error(e)
    return queued(request_id, model_id)


@router.get("/training_runs")
def list_training_runs(manager: Manager, user: Caller, limit: int = Query(20, ge=1, le=1000),
                       offset: int = Query(0, ge=0)) -> dict[str, Any]:
    """The caller's training runs (`access_scope` and `project_id` are taken as the caller's own: runs are
    never shared)."""
    return manager.tinker.state.runs(user, limit, offset)


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, manager: Manager, user: Caller) -> dict[str, Any]:
    return manager.tinker.state.run(user, run_id)


@router.get("/training_runs/{run_id}/checkpoints")
def list_checkpoints(run_id: str, manager: Manager, user: Caller) -> dict[str, Any]:
    return manager.tinker.state.checkpoints(user, run_id)


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/peft",
            responses={200: {"content": {"application/x-tar": {}}, "description": "a tar of the PEFT directory"}})
def download_peft(run_id: str, checkpoint_id: str, manager: Manager, user: Caller) -> FileResponse:
    """trainyard's: the checkpoint's adapters as a tar of a PEFT adapter directory (`adapter_config.json`,
    `adapter_model.safetensors`), for `peft.PeftModel.from_pretrained(base, directory)`; a full fine-tuning's
    checkpoint as a tar of its whole model's Hugging Face directory (`from_pretrained(directory)`)."""
    archive = manager.tinker.state.peft_archive(user, run_id, checkpoint_id)
    name = f"{run_id}_{checkpoint_id.replace('/', '_')}_peft.tar".replace(":", "_")
    return FileResponse(archive, media_type="application/x-tar", filename=name)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", status_code=204)
def delete_checkpoint(run_id: str, checkpoint_id: str, manager: Manager, user: Caller) -> Response:
    manager.tinker.state.delete(user, run_id, checkpoint_id)
    return Response(status_code=204)


@router.get("/checkpoints")
def list_user_checkpoints(manager: Manager, user: Caller, limit: int = Query(100, ge=1, le=1000),
                          offset: int = Query(0, ge=0)) -> dict[str, Any]:
    return manager.tinker.state.user_checkpoints(user, limit, offset)


@router.post("/weights_info")
def weights_info(body: WeightsInfoBody, manager: Manager, user: Caller) -> dict[str, Any]:
    return manager.tinker.state.weights_info(user, body.tinker_path)
