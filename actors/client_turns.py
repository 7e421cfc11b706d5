"""Whose call runs next on a training client's ranks (`actors.client_session`), which several tenants may share
(`parallel.runtime.tinker.tenants`): each tenant's calls run in the order the service numbered them (from 0), one
call at a time on the ranks, and among the tenants whose next call is waiting, the user served longest ago goes first (a
round robin by user), then that user's tenant served longest ago: a user with many clients, or many calls queued,
takes no more turns than one with one. Pure: the actor waits on it and tells it what started and ended."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Turns:
    next: dict[str, int] = field(default_factory=dict)
    """Each tenant's number of the call whose turn it is (0 until its first call ran)."""
    waiting: dict[str, dict[int, str]] = field(default_factory=dict)
    """Each tenant's calls waiting to run: their numbers, and the user who made them."""
    served: dict[str, int] = field(default_factory=dict)
    """When each user and each tenant was last served (`clock` then); never served: first in line."""
    clock: int = 0
    busy: bool = False
    """A call runs on the ranks now."""

    def arrive(self, tenant: str, seq: int, user: str) -> None:
        self.waiting.setdefault(tenant, {})[seq] = user

    def pick(self) -> tuple[str, int] | None:
        """The call to run next: (tenant, its number), or None while one runs or no tenant's next call waits."""
        if self.busy:
            return None
        heads = [(self.served.get(f"user:{calls[n]}", -1), self.served.get(f"tenant:{t}", -1), t, n)
                 for t, calls in self.waiting.items() if (n := self.next.get(t, 0)) in calls]
        if not heads:
            return None
        *_, tenant, seq = min(heads)
        return tenant, seq

    def start(self, tenant: str, seq: int) -> None:
        user = self.waiting[tenant].pop(seq)
        self.busy, self.clock = True, self.clock + 1
        self.served[f"user:{user}"] = self.served[f"tenant:{tenant}"] = self.clock

    def done(self, tenant: str) -> None:
        """The running call of `tenant` ended (raised or not): its next call's turn."""
        self.busy = False
        self.next[tenant] = self.next.get(tenant, 0) + 1
