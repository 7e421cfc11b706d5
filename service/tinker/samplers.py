"""The Tinker-compatible API's sampling clients: sampler weights saved from a training client, the sampling
sessions that read them, and their samples, each a future on the serving client's actor (`TinkerClients`' lock,
clients and futures; this holds only what sampling adds).

A sampler is served by live ranks, never a file: `save_weights_for_sampler` snapshots the training client's
trainable weights in its rank's memory under a name (`tinker://<model id>/sampler_weights/<name>`; unnamed, for
`save_weights_and_get_sampling_client`, a sampling session made at once on it; `kind` "inflight": one shared
snapshot each save replaces), and a sample of it runs on that rank with the snapshot swapped in, queued in order
with the client's training calls. A sampler of a base model (`create_sampling_client(base_model=...)`) gets a
client of its own, a LoRA client never stepped (its adapters add zero: the base model's numbers), one per session
and base model, released with its session.

Everything is per user: another user's sampling session, model path or training client answers as a missing one
(`ClientNotFound`, a 404), also a sampler whose training client was unloaded or whose unnamed weights were dropped
(a client keeps `MAX_NAMED` named and its last `MAX_EPHEMERAL` unnamed sampler weights, besides the inflight one).
A request the ranks cannot serve is a `RuleError` naming its field (`parallel.runtime.sampling.params`, torch-free),
before any rank runs.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainyard.parallel.config import RuleError
from trainyard.parallel.runtime.sampling.params import MAX_EPHEMERAL, MAX_NAMED, SampleError, has_tokenizer, sample_call
from trainyard.service.errors import ClientNotFound
from trainyard.service.tenancy.users import User

if TYPE_CHECKING:
    from trainyard.service.tinker.clients import Client, TinkerClients

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A sampler weights' name (`save_weights_for_sampler(name)`)."""
PATH = re.compile(r"tinker://([^/]+)/sampler_weights/([^/]+)")
INFLIGHT = "@inflight"
"""The snapshot every `kind="inflight"` save of a client replaces."""


@dataclass
class SamplingSession:
    owner: str
    session_id: str
    """The SDK session it belongs to (it ends with it)."""
    model_id: str
    """The client whose rank serves it."""
    weights: str | None
    """The snapshot on that rank it samples (None: the rank's live weights, a base model's own client)."""
    base_model: str
    model_path: str | None
    clones: int = 0
    """The `join_sampling_session` ids handed out."""


class TinkerSamplers:
    def __init__(self, clients: TinkerClients):
        self.clients = clients
        self.sessions: dict[str, SamplingSession] = {}
        self.saved: dict[str, dict[str, bool]] = {}
        """model id -> its sampler weights' names -> unnamed (in the order saved)."""
        self.bases: dict[tuple[str, str, str], str] = {}
        """(user, session, base model) -> the model id of the client serving its base-model samplers."""

    def save_for_sampler(self, user: User, model_id: str, name: str | None, kind: str = "snapshot") -> str:
        """The training client's weights now as sampler weights (`name`; None: unnamed, answered with a sampling
        session on them); a request id whose result is the SDK's answer once the rank holds them."""
        if name is not None and not NAME.fullmatch(name):
            raise RuleError("path", "a name of 1 to 128 letters, digits, '.', '_' or '-' (not starting with one of "
                                    "the last three)")
        if kind not in ("snapshot", "inflight"):
            raise RuleError("kind", "snapshot or inflight")
        clients = self.clients
        with clients._lock:
            client = clients._client(user, model_id)
            saved = self.saved.setdefault(model_id, {})
            snapshot = name if name is not None else INFLIGHT if kind == "inflight" else f"@{uuid.uuid4().hex[:12]}"
            unnamed = name is None
            if not unnamed and name not in saved and sum(not u for u in saved.values()) >= MAX_NAMED:
                raise RuleError("path", f"a training client keeps at most {MAX_NAMED} named sampler weights: "
                                        "save under a name it has")
            drop = []
            if unnamed and snapshot not in saved:
                older = [n for n, u in saved.items() if u and n != INFLIGHT]  # the inflight one stays
                drop = older[:max(0, len(older) - MAX_EPHEMERAL + 1)]
            for old in drop:
                del saved[old]
            saved.pop(snapshot, None)
            saved[snapshot] = unnamed
            if unnamed:
                answer = {"sampling_session_id": self._new_session(user, client, model_id, snapshot, None),
                          "type": "save_weights_for_sampler"}
            else:
                answer = {"path": f"tinker://{model_id}/sampler_weights/{name}", "type": "save_weights_for_sampler"}
            ref = clients.submit(client, "save_for_sampler", snapshot, drop, answer)
            return clients._future(user, ref, model_id)

    def create_session(self, user: User, session_id: str, model_path: str | None, base_model: str | None) -> str:
        """A sampling session on `model_path`'s sampler weights, or on `base_model` (a client of its own, made
        here: RuleError naming `base_model` when it cannot be one); its id."""
        clients = self.clients
        with clients._lock:
            clients._session(user, session_id)
            self._forget_ended()
            if model_path is not None:
                match = PATH.fullmatch(model_path)
                if match is None:
                    raise RuleError("model_path", "not a tinker://<model id>/sampler_weights/<name> path this "
                                                  "service saved")
                model_id, name = match.groups()
                client = clients.clients.get(model_id)
                if client is None or client.owner != user.name or name not in self.saved.get(model_id, {}):
                    raise ClientNotFound(model_path)
                return self._new_session(user, client, model_id, name, model_path, session_id)
            if base_model is None:
                raise RuleError("model_path", "give model_path (saved sampler weights) or base_model")
            model_id = self.bases.get((user.name, session_id, base_model), "")
            client = clients.clients.get(model_id)
            if client is not None and client.owner == user.name:
                return self._new_session(user, client, model_id, None, None, session_id)
        model_id, _ = clients.create_model(user, session_id, base_model, 1)  # builds its rank in the background
        with clients._lock:
            self.bases[(user.name, session_id, base_model)] = model_id
            return self._new_session(user, clients._client(user, model_id), model_id, None, None, session_id)

    def info(self, user: User, sampler_id: str) -> dict[str, Any]:
        with self.clients._lock:
            s = self._sampling(user, sampler_id)
            return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def join(self, user: User, sampler_id: str) -> int:
        with self.clients._lock:
            s = self._sampling(user, sampler_id)
            s.clones += 1
            return s.clones

    def sample(self, user: User, sampler_id: str | None, model_path: str | None, request: dict[str, Any]
               ) -> tuple[str, list[str]]:
        """A sample (`request`: the SDK's SampleRequest as plain data, its prompt a flat list of token ids) on a
        sampling session, or on saved sampler weights directly (`model_path`): its request id and the ids of the
        sequences it will answer."""
        clients = self.clients
        with clients._lock:
            if sampler_id is not None:
                s = self._sampling(user, sampler_id)
                model_id, weights, what = s.model_id, s.weights, s.model_path or sampler_id
            elif model_path is not None and (match := PATH.fullmatch(model_path)) is not None:
                (model_id, weights), what = match.groups(), model_path
            else:
                raise RuleError("sampling_session_id", "give a sampling session (or a tinker://<model id>/"
                                                       "sampler_weights/<name> model_path)")
            client = clients.clients.get(model_id)
            if client is None or client.owner != user.name:
                raise ClientNotFound(f"{what} (its training client is gone)")
            if weights is not None and weights not in self.saved.get(model_id, {}):
                raise ClientNotFound(f"{what} (its weights were dropped: a client keeps its last {MAX_EPHEMERAL} "
                                     "unnamed sampler weights)")
            try:
                sample_call(request, client.seq_len, client.vocab_size, has_tokenizer(client.directory))
            except SampleError as e:
                raise RuleError(e.field, e.message) from None
            ref = clients.submit(client, "sample", request, weights)
            request_id = clients._future(user, ref, model_id)
        n = int(request.get("num_samples", 1))
        return request_id, [f"seq-{uuid.uuid4().hex[:16]}" for _ in range(n)]

    def _new_session(self, user: User, client: Client, model_id: str, weights: str | None, model_path: str | None,
                     session_id: str | None = None) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
        self.sessions[sampler_id] = SamplingSession(user.name, session_id or client.session_id, model_id, weights,
                                                    client.base_model, model_path)
        return sampler_id

    def _sampling(self, user: User, sampler_id: str) -> SamplingSession:
        s = self.sessions.get(sampler_id)
        if s is None or s.owner != user.name or s.session_id not in self.clients.sessions:
            raise ClientNotFound(sampler_id)
        return s

    def _forget_ended(self) -> None:
        """Drop the sampling sessions whose session ended and the records of clients gone (under the lock)."""
        live = self.clients.sessions
        for sid in [sid for sid, s in self.sessions.items() if s.session_id not in live]:
            del self.sessions[sid]
        for mid in [mid for mid in self.saved if mid not in self.clients.clients]:
            del self.saved[mid]
        for key in [k for k, mid in self.bases.items() if mid not in self.clients.clients]:
            del self.bases[key]
