"""The Tinker-compatible training API (`/api/v1/...`): the routes the official Tinker SDK calls for
`ServiceClient` -> `create_lora_training_client` -> `forward_backward` / `forward` -> `optim_step` -> `.result()`.

The SDK authenticates with `X-API-Key: tml-<trainyard token>` (`api.guard`); every session, model and request id
belongs to its caller, and another user's answers as a missing one (a 404). Calls on a model return a future (a
request id) at once; `retrieve_future` answers its result, a `try_again` while it runs, or the error (its category
`user` for the caller's mistakes). forward_backward's request and result are protobuf (`api.tinker_wire`), and a
sample's result (`api.tinker_sample_wire`; the sampling routes: `api.routes.tinker_sampling`), the rest JSON. The
live state is the manager's `tinker` (`service.tinker.TinkerClients`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import AliasChoices, BaseModel, ConfigDict, Field
from trainyard.api.deps import Caller, Manager
from trainyard.api.tinker_sample_wire import write_sample
from trainyard.api.tinker_wire import SdkMissing, WireError, read_forward_backward, write_forward_backward
from trainyard.parallel.config import RuleError

router = APIRouter(prefix="/api/v1", tags=["tinker"])
PROTO = "application/x-protobuf"
PARALLEL_KEY = "trainyard_parallel"
FULL_KEY = "trainyard_full_finetune"
"""user_metadata's trainyard extension for full fine-tuning: true trains every weight of the base model instead of
LoRA adapters (the SDK's create_lora_training_client always sends a lora_config; a create_model without one is full
fine-tuning too)."""
"""The `user_metadata` key of create_model that asks for a layout (trainyard's extension)."""
RETRIEVE_WAIT_S = 5.0
"""How long one retrieve_future waits for its call before answering try_again (the SDK allows 45 s)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SessionBody(_Body):
    session_id: str = Field(max_length=200)


class LoraBody(_Body):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModelBody(_Body):
    session_id: str = Field(max_length=200)
    base_model: str = Field(min_length=1, max_length=4096)
    lora_config: LoraBody | None = None
    user_metadata: dict[str, Any] | None = None
    """trainyard's extensions: `trainyard_parallel`, the layout as a JobSpec's `parallel` (an object, or its JSON);
    `trainyard_full_finetune`, true (or "true") for full fine-tuning (`FULL_KEY`)."""


class ModelBody(_Body):
    model_id: str = Field(max_length=200)


class AdamBody(_Body):
    learning_rate: float = Field(default=1e-4, gt=0, le=10)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    grad_clip_norm: float = Field(default=0.0, ge=0)


class OptimStepBody(ModelBody):
    adam_params: AdamBody = Field(default_factory=AdamBody, validation_alias=AliasChoices("adam_params",
                                                                                          "optim_params"))
    optimizer_params: dict[str, Any] | None = None
    """Another optimizer than Adam (the SDK sends its params here): refused, a 422 naming it."""


class RetrieveBody(_Body):
    request_id: str = Field(max_length=200)


def _field_error(field: str, message: str) -> JSONResponse:
    """A 422 in the API's shape, naming the field (and no data of the request)."""
    return JSONResponse(status_code=422, content={"detail": [{"loc": ["body", *field.split(".")], "field": field,
                                                              "msg": message, "type": "value_error"}]})


def queued(request_id: str, model_id: str) -> dict[str, Any]:
    """The SDK's answer to a call it polls for (`retrieve_future`): the request to poll and the model it is on."""
    return {"request_id": request_id, "model_id": model_id}


def layout_error(e: RuleError) -> JSONResponse:
    """A plan rule's 422, its `parallel...` field named as the client sends it (under `user_metadata`)."""
    field = f"user_metadata.{PARALLEL_KEY}{e.field.removeprefix('parallel')}" \
        if e.field.startswith("parallel") else e.field
    return _field_error(field, e.message)


def requested_full(user_metadata: dict[str, Any] | None) -> bool | JSONResponse:
    """Whether `user_metadata` asks for full fine-tuning (`FULL_KEY`: true or false, or their JSON), or the 422."""
    full = (user_metadata or {}).get(FULL_KEY, False)
    if full in ("true", "false"):
        full = full == "true"
    if not isinstance(full, bool):
        return _field_error(f"user_metadata.{FULL_KEY}", "must be true or false")
    return full


def requested_layout(user_metadata: dict[str, Any] | None) -> dict[str, Any] | None | JSONResponse:
    """The layout `user_metadata` asks for (`PARALLEL_KEY`: a JobSpec's `parallel`, an object or its JSON), None
    for the default, or the 422 naming the field."""
    parallel = (user_metadata or {}).get(PARALLEL_KEY)
    if isinstance(parallel, str):
        try:
            parallel = json.loads(parallel)
        except ValueError:
            return _field_error(f"user_metadata.{PARALLEL_KEY}", "not JSON")
    if parallel is not None and not isinstance(parallel, dict):
        return _field_error(f"user_metadata.{PARALLEL_KEY}", "not an object (a JobSpec's parallel)")
    return parallel


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config")
def client_config() -> dict[str, Any]:
    """The SDK's feature flags: API keys (no JWT exchange), forward_backward uncompressed, httpx's transport."""
    return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "proto_compress_fwdbwd": False,
            "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False, "custom_loss_server_side": False,
            "fwdbwd_max_chunk_bytes_count": 900_000}  # under the JSON body limit (`api.guard.MAX_JSON_BODY`)


@router.post("/client/dynamic_config")
def client_dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
def telemetry() -> dict[str, str]:
    """The SDK's telemetry, accepted and dropped."""
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
def capabilities(manager: Manager, _: Caller) -> dict[str, Any]:
    return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                 for name in manager.tinker.base_models()]}


@router.post("/create_session")
def create_session(manager: Manager, user: Caller) -> dict[str, Any]:
    return {"type": "create_session", "session_id": manager.tinker.create_session(user)}


@router.post("/session_heartbeat")
def session_heartbeat(body: SessionBody, manager: Manager, user: Caller) -> dict[str, Any]:
    manager.tinker.heartbeat(user, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/create_model")
def create_model(body: CreateModelBody, manager: Manager, user: Caller) -> Any:
    parallel, full = requested_layout(body.user_metadata), requested_full(body.user_metadata)
    if isinstance(parallel, JSONResponse):
        return parallel
    if isinstance(full, JSONResponse):
        return full
    lora = None if full else body.lora_config
    try:
        model_id, request_id = manager.tinker.create_model(
            user, body.session_id, body.base_model, None if lora is None else lora.rank,
            seed=None if lora is None else lora.seed,
            targets=None if lora is None else (lora.train_attn, lora.train_mlp, lora.train_unembed), parallel=parallel)
    except RuleError as e:
        return layout_error(e)
    return queued(request_id, model_id)


@router.post("/get_info")
def get_info(body: ModelBody, manager: Manager, user: Caller) -> dict[str, Any]:
    info = manager.tinker.info(user, body.model_id)
    return {"type": "get_info", "model_id": body.model_id,
            "model_data": {"arch": info["family"], "model_name": info["base_model"], "tokenizer_id": None},
            "is_lora": info["lora_rank"] is not None, "lora_rank": info["lora_rank"]}


@router.post("/forward_backward")
async def forward_backward(request: Request, manager: Manager, user: Caller) -> Any:
    """The SDK's protobuf ForwardBackwardRequest (`forward_only` set: a `forward`)."""
    if request.headers.get("content-encoding"):
        return _field_error("content-encoding", "compressed bodies are not served (the client config says so)")
    try:
        call = read_forward_backward(await request.body())
    except WireError as e:
        return _field_error(e.field, e.message)
    except SdkMissing as e:
        return JSONResponse(status_code=501, content={"detail": str(e)})
    return queued(manager.tinker.forward_backward(user, call.model_id, call.data, call.loss_fn, call.forward_only,
                                                  call.loss_fn_config), call.model_id)


@router.post("/optim_step")
def optim_step(body: OptimStepBody, manager: Manager, user: Caller) -> Any:
    if body.optimizer_params is not None:
        return _field_error("optimizer_params", "only Adam (adam_params) is served yet")
    return queued(manager.tinker.optim_step(user, body.model_id, body.adam_params.model_dump()), body.model_id)


@router.post("/unload_model")
def unload_model(body: ModelBody, manager: Manager, user: Caller) -> dict[str, Any]:
    return queued(manager.tinker.unload(user, body.model_id), body.model_id)


@router.post("/retrieve_future")
def retrieve_future(body: RetrieveBody, manager: Manager, user: Caller) -> Any:
    state, value = manager.tinker.retrieve(user, body.request_id, RETRIEVE_WAIT_S)
    if state == "pending":
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    if state == "queued":  # the training client waits in the service's queue (its owner's quota, or the cluster)
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "paused_capacity"}
    if state != "done":
        return {"error": value, "category": "user" if state == "user_error" else "server"}
    assert isinstance(value, dict)
    if value.get("type") == "sample":  # a sample's result: the SDK reads it as protobuf only
        try:
            return Response(write_sample(value), media_type=PROTO)
        except SdkMissing as e:
            return JSONResponse(status_code=501, content={"detail": str(e)})
    if "logprobs" in value:  # a forward_backward's result: the SDK reads it as protobuf only
        try:
            return Response(write_forward_backward(value), media_type=PROTO)
        except SdkMissing as e:
            return JSONResponse(status_code=501, content={"detail": str(e)})
    return value
