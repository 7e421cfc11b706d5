"""Tenants of the Tinker-compatible API (issue 62): a LoRA client of a base model, LoRA rank and layout that a live
client already runs on (its config the same but for the seed: `key`) attaches to that client's ranks as a new tenant
(`actors.client_session.ClientSession.attach`, `parallel.runtime.tinker.tenants`) instead of queueing for ranks of its
own, when its owner's quota holds it as if it had its own: its row charges as a client's, and over the quota it waits in
the queue as any client does. It is a client as the others are (its own model id, owned by its user, its own job row;
another user's call naming it answers as a missing one); the ranks hold the base once, each tenant its adapters,
optimizer state, step count and sampler weights. Its calls take turns with the other tenants' by user
(`actors.client_turns`). Its end drops its state on the ranks (`detach`, `TinkerClients._end`); the actor and its group
go with the last client on them.

No torch here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from trainyard.actors.job_status import JobStatus
from trainyard.parallel.spec import spec_to_dict
from trainyard.service.store import JobRecord
from trainyard.service.tenancy import quota
from trainyard.service.tenancy.users import User

if TYPE_CHECKING:
    from trainyard.service.tinker.clients import TinkerClients


def key(config: Any) -> dict:
    """What two clients must have alike to share ranks: their whole config but the seed (the base model, LoRA's
    rank and targets, the layout)."""
    spec = dict(spec_to_dict(config))
    spec.pop("seed", None)
    return spec


def attach(clients: TinkerClients, user: User, session_id: str, base_model: str, lora_rank: int | None, config: Any,
           plan: Any, charge: dict[str, float], model_id: str, seed: int, targets: Any) -> str | None:
    """The new client as a tenant on a live client's ranks (module doc): the request id of its attach, or None when
    no live client runs its base and layout, or its owner's quota does not hold it now."""
    from trainyard.service.tinker.clients import Client

    if lora_rank is None:
        return None
    held = quota.usage(clients.tenancy.store.live_needs()).get(user.name, {})
    if clients.tenancy.quotas(user.name).over(held, charge) is not None:
        return None  # it waits in the queue, as a client of its own would
    wanted = key(config)
    with clients._lock:
        host = next((c for c in clients.clients.values() if c.lora_rank is not None and c.pg is not None
                     and key(c.config) == wanted and _running(clients, c.model_id)), None)
        if host is None:
            return None
        client = Client(user.name, session_id, base_model, lora_rank, config.model.family, charge, host.pg,
                        host.actor, None, admitted=time.monotonic(), seq_len=config.model.seq_len,
                        vocab_size=config.model.vocab_size, directory=host.directory, config=config,
                        args={"seed": seed, "targets": targets}, model_id=model_id, calls=0)
        client.ready = clients.submit(client, "attach", seed)
        clients.clients[model_id] = client
        clients.tenancy.store.insert(JobRecord(
            job_id=model_id, name=f"tinker-{config.model.family}", status=JobStatus.RUNNING,
            spec=spec_to_dict(config), steps=0, needs=quota.needs(plan), owner=user.name, kind="tinker",
            events=[{"time": time.time(), "kind": "tinker_client", "cause": f"a training client of {base_model} "
                     f"(LoRA rank {lora_rank}) on a live client's ranks of the same base and layout (the base held "
                     "once), its calls made by the user's program"}]))
        return clients._future(user, client.ready, model_id)


def _running(clients: TinkerClients, model_id: str) -> bool:
    """Whether client `model_id`'s ranks are built (its job row RUNNING)."""
    record = clients.tenancy.store.get(model_id)
    return record is not None and record.status == JobStatus.RUNNING
