"""The one place a resize is decided, whoever asks (a `scale` request, the elastic grower): a request claims the
desk before it waits for resources and is refused while another holds it, so two requests can never overwrite each
other, and a claim taken while the job was RUNNING is checked again when its resources are ready."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from trainyard.parallel.plan import Plan

log = logging.getLogger("trainyard.coordinator")


@dataclass(frozen=True)
class Resize:
    """A resize the desk accepted: the new plan, why, and when it was asked for."""

    plan: Plan
    reason: str
    asked: float


class ResizeDesk:
    """Where resizes are decided: at most one is claimed or ready at a time.

    `request` claims the desk synchronously (no await between the check and the claim, so two coroutines of
    the actor's event loop cannot both pass it), then awaits the resources, then checks the job again."""

    def __init__(self) -> None:
        self.claimed_by: str | None = None
        self.ready: Resize | None = None
        """The resize the controller takes at the next step boundary."""

    def take(self) -> Resize | None:
        resize, self.ready = self.ready, None
        return resize

    async def request(self, new: Plan, reason: str, asked: float, running: Callable[[], bool],
                      current: Callable[[], Plan], reserve: Callable[[], Awaitable[str | None]]) -> str | None:
        """Accept a resize to `new` (None) or say why not. `running`: whether the job can be resized now;
        `current`: the job's plan now; `reserve`: reserves the added ranks' resources, or says why it cannot."""
        if not running() or self.claimed_by is not None or self.ready is not None:
            busy = self.claimed_by or (self.ready.reason if self.ready else None)
            return f"resizing already ({busy})" if busy else "not running"
        self.claimed_by, before = reason, current()
        try:
            problem = await reserve()
            if problem:
                return problem
            if not running() or current() is not before:
                return "the job changed while the resources were reserved (a failure or a resize); ask again"
            self.ready = Resize(new, reason, asked)
            log.info("resize to dp=%d accepted (%s)", new.dp, reason)
            return None
        finally:
            self.claimed_by = None
