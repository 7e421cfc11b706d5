"""The Tinker-compatible API's live state: sessions (kept alive by the SDK's heartbeats), training clients (each a
`ClientSession` actor, a live job of its own kind holding its ranks between calls) and the futures of the calls made
on them (the sampling clients' part: `samplers`). Everything is per user: another user's session, model or request
answers as a missing one (`ClientNotFound`).

A client is a job of kind `tinker` in the service's store and queue: `create_model` queues it (its owner's quota and
the cluster's free resources admit it, in the queue's order, as they admit jobs; `Admission` reserves its group and
calls `admitted`), and its row ends STOPPED at `unload` (or when its session stops beating, or the service shuts
down) or FAILED when its ranks fail. A call returns a request id at once; its work is queued on the client's actor,
numbered (`submit`: the actor runs the calls in that order, those made while it waits in the queue once it is
built), and `retrieve` waits a bounded time for it: done, failed (with the error's category: the caller's, or the
server's), or still pending or queued (the SDK asks again). A session whose heartbeat stops for
`heartbeat_timeout_s` is closed and its clients released, as `unload` releases one.

Tenants (`service.tinker.sharing`): a LoRA client may attach to a live client's ranks of the same base and layout
instead of having its own; its end drops its state there (`detach`), and the ranks go with the last client on them.

No torch here: the ranks import it in their own processes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from trainyard.actors.client_session import ClientSession
from trainyard.actors.job_status import JobStatus
from trainyard.parallel.config import RuleError
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import spec_to_dict
from trainyard.service.errors import ClientNotFound
from trainyard.service.ray_runtime import cluster_resources
from trainyard.service.store import JobRecord
from trainyard.service.tenancy import quota
from trainyard.service.tenancy.requests import Tenancy
from trainyard.service.tenancy.users import User
from trainyard.service.tinker import sharing
from trainyard.service.tinker.samplers import TinkerSamplers
from trainyard.service.tinker.specs import client_config
from trainyard.service.tinker.state import TinkerState

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 60.0
"""A session whose SDK sent no heartbeat for this long is closed (the SDK beats every 10 s)."""
SETUP_TIMEOUT_S = 300.0
"""A client's rank that is not built within this is a failed `create_model`, never a hang."""
CALL_TIMEOUT_S = 600.0
"""A call on a client's rank still running after this fails, and the client with it."""


@dataclass
class Session:
    owner: str
    beat: float = field(default_factory=time.monotonic)


@dataclass
class Client:
    owner: str
    session_id: str
    base_model: str
    lora_rank: int | None
    family: str
    charge: dict[str, float]
    """What the client holds against its owner's quota (`quota.charge` of its plan)."""
    pg: Any
    """Its ranks' placement group, once admission reserved it (None while it waits in the queue)."""
    actor: Any
    ready: Any
    """The ObjectRef of the rank's build (`ClientSession.setup`)."""
    admitted: float | None = None
    """When admission handed it its placement group (monotonic); None while it waits in the queue."""
    calls: int = 1
    """The number the next call on it takes (`ClientSession.run`; `setup` is 0)."""
    seq_len: int = 0
    vocab_size: int = 0
    directory: str | None = None
    """The base model's Hugging Face directory (its tokenizer, for a sample's stop strings)."""
    config: Any = None
    """Its JobConfig (`service.tinker.specs.client_config`)."""
    args: dict[str, Any] = field(default_factory=dict)
    """`create_model`'s `seed` and `targets`, which a checkpoint records to make the client again
    (`service.tinker.state`)."""
    model_id: str = ""
    """Its model id: its tenant's name on the ranks it runs on (its own, or another client's: `actor`)."""


@dataclass
class Future:
    owner: str
    ref: Any | None
    """The call's ObjectRef (None: answered already, in `value`)."""
    value: dict[str, Any] | None = None
    started: float = field(default_factory=time.monotonic)
    model_id: str | None = None


class TinkerClients:
    """The sessions, clients and futures of every user, behind one lock."""

    def __init__(self, tenancy: Tenancy, registered: Mapping[str, str] | None = None,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S):
        """`registered`: the base models the operator named (`trainyard serve --base-model NAME=DIR`)."""
        self.tenancy, self.registered = tenancy, dict(registered or {})
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.sessions: dict[str, Session] = {}
        self.clients: dict[str, Client] = {}
        self.futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.wake: Callable[[], None] = lambda: None
        """Wakes the admission thread (the manager's), which admits a client created here."""
        self.samplers = TinkerSamplers(self)
        """The sampling clients: sampler weights, sampling sessions, samples (`service.tinker.samplers`)."""
        self.state = TinkerState(self)
        """The clients' saved state: checkpoints, and the runs that wrote them (`service.tinker.state`)."""

    def base_models(self) -> list[str]:
        return sorted(self.registered)

    def create_session(self, user: User) -> str:
        self._start_reaper()
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self.sessions[session_id] = Session(user.name)
        return session_id

    def heartbeat(self, user: User, session_id: str) -> None:
        with self._lock:
            self._session(user, session_id).beat = time.monotonic()

    def create_model(self, user: User, session_id: str, base_model: str, lora_rank: int | None,
                     seed: int | None = None, targets: tuple[bool, bool, bool] | None = None,
                     parallel: Mapping[str, Any] | None = None, model_id: str | None = None) -> tuple[str, str]:
        """A new training client: (its model id, the request id whose result is the client once its rank is
        built). `targets`: LoRA on (attention, MLP, unembedding); `parallel`: the layout (a JobSpec's `parallel`;
        default one rank); `model_id`: the id the SDK derived for it (a client made from a checkpoint), else a new
        one. RuleError naming the field for a base model, rank or layout it cannot be."""
        with self._lock:
            self._session(user, session_id)
            if model_id is not None and model_id in self.clients:
                raise RuleError("model_seq_id", "this session has a training client of this seq id already")
        config = client_config(self.tenancy, user, base_model, lora_rank, self.registered, seed or 0, targets,
                               parallel)
        plan = make_plan(config, cluster_resources())
        charge = quota.charge(plan)
        limits = self.tenancy.quotas(user.name)
        beyond = limits.never_fits(charge)
        if beyond is not None:
            raise RuleError("base_model", beyond)
        model_id = model_id or f"model-{uuid.uuid4().hex[:16]}"
        attached = sharing.attach(self, user, session_id, base_model, lora_rank, config, plan, charge, model_id,
                                  seed or 0, targets)
        if attached is not None:
            return model_id, attached
        with self._lock:
            # A job of kind `tinker` in the service's queue: admitted within its owner's quota and the cluster's free
            # resources, in the queue's order (`Admission`), which reserves its placement group and calls
            # `admitted`. Its actor is made now and holds nothing; the calls made meanwhile wait in it.
            # The session holds no resources of its own (as a job's coordinator); its ranks are in the group.
            actor = ClientSession.options(  # type: ignore[attr-defined]  # an ActorClass (@ray.remote)
                name=f"trainyard/tinker/{model_id}", num_cpus=0, max_restarts=0, max_concurrency=1000,
            ).remote(model_id, plan)
            ready = actor.run.remote(model_id, user.name, 0, "setup")
            self.clients[model_id] = Client(user.name, session_id, base_model, lora_rank, config.model.family,
                                            charge, None, actor, ready, seq_len=config.model.seq_len,
                                            vocab_size=config.model.vocab_size,
                                            directory=config.init_from.hf if config.init_from is not None else None,
                                            config=config, args={"seed": seed or 0, "targets": targets},
                                            model_id=model_id)
            trained = "full fine-tuning" if lora_rank is None else f"LoRA rank {lora_rank}"
            self.tenancy.store.insert(JobRecord(
                job_id=model_id, name=f"tinker-{config.model.family}", status=JobStatus.PENDING,
                spec=spec_to_dict(config), steps=0, needs=quota.needs(plan), owner=user.name, kind="tinker",
                events=[{"time": time.time(), "kind": "tinker_client", "cause": f"a training client of {base_model} "
                         f"({trained}), its calls made by the user's program"}]))
            request_id = self._future(user, ready, model_id)
        self.wake()
        return model_id, request_id

    def admitted(self, model_id: str, plan: Any, pg: Any) -> None:
        """Admission reserved client `model_id`'s placement group (`Admission.start_client`): its actor builds
        its ranks in it. A client unloaded meanwhile gives the group back."""
        with self._lock:
            client = self.clients.get(model_id)
            if client is not None:
                client.pg, client.admitted = pg, time.monotonic()
                client.actor.admit.remote(pg)
        if client is None:
            remove_placement_group(pg)
            self.tenancy.store.update(model_id, status=JobStatus.STOPPED)

    def stop(self, model_id: str) -> None:
        """The client ended through the jobs API (`JobManager.stop`): as an unload."""
        with self._lock:
            client = self.clients.pop(model_id, None)
        self._end(model_id, client, JobStatus.STOPPED)

    def submit(self, client: Client, method: str, *args: Any) -> Any:
        """`method` on the client's actor in its turn (after every call made before it); the caller holds the
        lock. The call's ObjectRef."""
        seq, client.calls = client.calls, client.calls + 1
        return client.actor.run.remote(client.model_id, client.owner, seq, method, *args)

    def info(self, user: User, model_id: str) -> dict[str, Any]:
        with self._lock:
            client = self._client(user, model_id)
            return {"model_id": model_id, "base_model": client.base_model, "lora_rank": client.lora_rank,
                    "family": client.family}

    def forward_backward(self, user: User, model_id: str, data: list[dict[str, list]], loss_fn: str,
                         forward_only: bool, config: dict[str, float] | None = None) -> str:
        with self._lock:
            client = self._client(user, model_id)
            ref = self.submit(client, "forward_backward", data, loss_fn, forward_only, config)
            return self._future(user, ref, model_id)

    def optim_step(self, user: User, model_id: str, adam: dict[str, float]) -> str:
        with self._lock:
            client = self._client(user, model_id)
            return self._future(user, self.submit(client, "optim_step", adam), model_id)

    def unload(self, user: User, model_id: str) -> str:
        with self._lock:
            client = self._client(user, model_id)
            del self.clients[model_id]
            request_id = self._future(user, None, model_id, {"model_id": model_id, "type": "unload_model"})
        self._end(model_id, client, JobStatus.STOPPED)
        return request_id

    def retrieve(self, user: User, request_id: str, wait_s: float) -> tuple[str, dict[str, Any] | str | None]:
        """("done", the call's result), ("failed", why: a line naming no data of the request), ("user_error",
        why) or ("pending", None) after `wait_s` without an answer."""
        with self._lock:
            future = self.futures.get(request_id)
            if future is None or future.owner != user.name:
                raise ClientNotFound(request_id)
        if future.ref is None:
            return "done", future.value
        client = self.clients.get(future.model_id or "")
        limit = SETUP_TIMEOUT_S if client is not None and future.ref is client.ready else CALL_TIMEOUT_S
        ready, _ = ray.wait([future.ref], timeout=wait_s)
        if not ready:
            if client is not None and client.admitted is None:  # waiting in the queue, as a job may
                return "queued", None
            started = max(future.started, client.admitted or 0.0) if client is not None else future.started
            if time.monotonic() - started < limit:
                return "pending", None
            why = f"the training client's rank did not answer within {limit:.0f} s; it was released"
            self._fail_client(future.model_id, why)
            return "failed", why
        try:
            value = ray.get(future.ref)
        except ray.exceptions.RayActorError:  # the rank's process is gone: so is the client
            why = ("the training client's rank died (its process ended), or the client was unloaded; it is "
                   "released: create a new training client")
            self._fail_client(future.model_id, why)
            return "failed", why
        except Exception as e:  # the rank's error, raised as its cause
            cause = getattr(e, "cause", None) or e
            message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            if type(cause).__name__ == "OpenLoopError":
                return "user_error", message[:500]
            if type(cause).__name__ == "ClientRecovered":  # a rank died; the client was rebuilt and goes on
                self.tenancy.store.add_events(future.model_id or "", [
                    {"time": time.time(), "kind": "tinker_recovered", "cause": message[:500]}])
                return "failed", message[:500]
            self._fail_client(future.model_id, message[:500])  # a rank failed under it: nothing more can run
            return "failed", f"{message[:500]} (the client was released)"
        if isinstance(value, dict) and "device" in value:  # the rank's build: the client is ready, its job RUNNING
            self.tenancy.store.update(value["model_id"], status=JobStatus.RUNNING)
            value = {"model_id": value["model_id"], "type": "create_model"}
        return "done", value

    def close(self) -> None:
        """Release every client (the service stops)."""
        self._stop.set()
        with self._lock:
            clients, self.clients, self.sessions = list(self.clients.items()), {}, {}
        for model_id, client in clients:
            self._end(model_id, client, JobStatus.STOPPED, "the service shut down; a Tinker training client does "
                                                           "not outlive it (its saved states remain)")

    def reap(self, now: float | None = None) -> None:
        """Close the sessions whose heartbeat stopped, releasing their clients; forget futures long answered.
        `now`: the monotonic time to judge by (default: now)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = {sid for sid, s in self.sessions.items() if now - s.beat > self.heartbeat_timeout_s}
            for sid in dead:
                del self.sessions[sid]
            gone = [(mid, c) for mid, c in self.clients.items() if c.session_id in dead]
            for mid, _ in gone:
                del self.clients[mid]
            for rid in [rid for rid, f in self.futures.items() if now - f.started > 4 * CALL_TIMEOUT_S]:
                del self.futures[rid]
        for mid, client in gone:
            log.info("tinker session %s stopped beating: releasing client %s", client.session_id, mid)
            self._end(mid, client, JobStatus.STOPPED, "its session's heartbeat stopped (the user's program ended "
                                                      "or lost the service)")

    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None:
                return
            self._reaper = threading.Thread(target=self._reap_loop, name="tinker-reaper", daemon=True)
        self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._stop.wait(min(5.0, self.heartbeat_timeout_s / 4)):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad pass
                log.exception("tinker reaper pass failed")

    def _fail_client(self, model_id: str | None, why: str = "a call on its ranks failed") -> None:
        with self._lock:
            client = self.clients.pop(model_id, None) if model_id is not None else None
        if client is not None and model_id is not None:
            self._end(model_id, client, JobStatus.FAILED, why)

    def _end(self, model_id: str, client: Client | None, status: JobStatus, error: str | None = None) -> None:
        """The client's job row ended (a queued one leaves the queue), then its actor and group released, or, while
        other clients are tenants on its ranks, its state dropped there (`detach`)."""
        self.tenancy.store.update(model_id, status=status, error=error)
        if client is None:
            return
        with self._lock:
            shared = any(c.actor is client.actor for c in self.clients.values())
            if shared:
                self.submit(client, "detach")
        if not shared:
            _release(client)

    def _session(self, user: User, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner != user.name:
            raise ClientNotFound(session_id)
        return session

    def _client(self, user: User, model_id: str) -> Client:
        client = self.clients.get(model_id)
        if client is None or client.owner != user.name:
            raise ClientNotFound(model_id)
        return client

    def _future(self, user: User, ref: Any | None, model_id: str | None, value: dict[str, Any] | None = None) -> str:
        request_id = f"req-{uuid.uuid4().hex}"
        self.futures[request_id] = Future(user.name, ref, value, model_id=model_id)
        return request_id


def _release(client: Client) -> None:
    """The client's actor gone, and its rank's process with it, and its reserved resources freed (what it never
    had is skipped: a call on Ray would start one in a process that has none)."""
    if client.actor is not None:
        try:
            ray.kill(client.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if client.pg is not None:
        try:
            remove_placement_group(client.pg)
        except Exception:  # noqa: BLE001 - already removed
            pass


__all__ = ["ClientNotFound", "RuleError", "TinkerClients"]
