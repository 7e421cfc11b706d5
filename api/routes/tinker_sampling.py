"""The Tinker-compatible API's sampling routes (`/api/v1/...`), as the official SDK calls them for
`save_weights_for_sampler`, `create_sampling_client` (and `save_weights_and_get_sampling_client`), `sample` and
`compute_logprobs`: saving sampler weights (a future), sampling sessions (their record, `GET samplers/{id}`, and
clone ids), and `asample` (a future; its result, read by `retrieve_future`, is the SDK's SampleResponse protobuf:
`api.tinker_sample_wire`). The live state is the manager's `tinker.samplers` (`service.tinker.samplers`).

A request's types are checked here (a 422 naming the field), its values against the model by the service (a 422
naming the field: `parallel.runtime.sampling.params`); another user's ids answer as missing ones (a 404).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from trainyard.api.deps import Caller, Manager
from trainyard.api.routes.tinker import queued
from trainyard.parallel.config import RuleError

router = APIRouter(prefix="/api/v1", tags=["tinker"])
MAX_CHUNKS = 4096
MAX_PROMPT_TOKENS = 1 << 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SaveForSamplerBody(_Body):
    model_id: str = Field(max_length=200)
    path: str | None = Field(default=None, max_length=200)
    """The sampler weights' name (None: unnamed, answered with a sampling session on them)."""
    kind: Literal["snapshot", "inflight"] = "snapshot"


class CreateSamplingSessionBody(_Body):
    session_id: str = Field(max_length=200)
    base_model: str | None = Field(default=None, min_length=1, max_length=4096)
    model_path: str | None = Field(default=None, min_length=1, max_length=600)


class JoinBody(_Body):
    sampling_session_id: str = Field(max_length=200)


class ChunkBody(_Body):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list, max_length=MAX_PROMPT_TOKENS)


class PromptBody(_Body):
    chunks: list[ChunkBody] = Field(max_length=MAX_CHUNKS)


class SamplingParamsBody(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[int] | list[str] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleBody(_Body):
    sampling_session_id: str | None = Field(default=None, max_length=200)
    model_path: str | None = Field(default=None, max_length=600)
    num_samples: int = 1
    prompt: PromptBody
    sampling_params: SamplingParamsBody
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveForSamplerBody, manager: Manager, user: Caller) -> dict[str, Any]:
    return queued(manager.tinker.samplers.save_for_sampler(user, body.model_id, body.path, body.kind), body.model_id)


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSessionBody, manager: Manager, user: Caller) -> dict[str, Any]:
    sampler_id = manager.tinker.samplers.create_session(user, body.session_id, body.model_path, body.base_model)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.post("/join_sampling_session")
def join_sampling_session(body: JoinBody, manager: Manager, user: Caller) -> dict[str, Any]:
    return {"type": "join_sampling_session",
            "client_counter": manager.tinker.samplers.join(user, body.sampling_session_id)}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, manager: Manager, user: Caller) -> dict[str, Any]:
    return manager.tinker.samplers.info(user, sampler_id)


@router.post("/asample")
def asample(body: SampleBody, manager: Manager, user: Caller) -> dict[str, Any]:
    """A sample's future: its request id, and the ids of the sequences it will answer (in their order)."""
    tokens: list[int] = []
    for i, chunk in enumerate(body.prompt.chunks):
        if chunk.type != "encoded_text":
            raise RuleError(f"prompt.chunks.{i}", "only encoded_text chunks are served yet")
        tokens += chunk.tokens
    request = body.model_dump(exclude={"prompt", "sampling_session_id", "model_path"}) | {"prompt": tokens}
    request_id, sequence_ids = manager.tinker.samplers.sample(user, body.sampling_session_id, body.model_path,
                                                              request)
    return {"request_id": request_id, "sample_sequence_ids": sequence_ids}
