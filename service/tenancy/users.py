"""The service's users: one bearer token each, kept hashed in the state directory's `users.json` (mode 0600).

`trainyard token create NAME [--admin] [--max-cpus N] [--max-gpus M] [--data-root DIR ...] [--max-queued N]
[--max-priority N] [--max-storage SIZE]` adds a user and prints their token once (`token update` changes the limits
later); only its SHA-256 is stored. The tokens are 32 random bytes, so an unsalted hash is as strong as a slow one
(nothing to guess); a stolen `users.json` gives no token. The state directory's `token` (the one `trainyard
serve` makes on first start) stays the admin's, user `admin`. An admin sees and controls every job; any other
user their own. The running service reads the file at each request, so a new or revoked token counts from the
next one, without a restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import hmac
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from trainyard.service.state_dir import new_token
from trainyard.service.store import ADMIN
from trainyard.service.tenancy.access import Owner, resolve
from trainyard.service.tenancy.quota import NO_QUOTA, Quota

USERS_FILE = "users.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


class UserError(ValueError):
    """A token command that cannot be done (a bad name, a user that exists or does not)."""


@dataclass(frozen=True)
class User:
    name: str
    admin: bool = False
    max_cpus: float | None = None
    max_gpus: float | None = None
    token_sha256: str = ""
    created_at: float = 0.0
    data_roots: tuple[str, ...] = ()
    """Directories (resolved when set) under which the user's jobs read data (`service.tenancy.access`)."""
    max_queued: int | None = None
    """Most of the user's jobs waiting in the queue at once (None: only the service's `--max-queued`)."""
    max_priority: int | None = 0
    """Highest `priority` the user's jobs may ask for (None: any; an admin's default)."""
    max_storage_bytes: int | None = None
    """Most bytes of uploads, checkpoints and models the user's files hold (None: no limit)."""

    @property
    def quota(self) -> Quota:
        return Quota(cpus=self.max_cpus, gpus=self.max_gpus)

    @property
    def owner(self) -> Owner:
        return Owner(self.name, self.admin, self.data_roots)

    @staticmethod
    def from_dict(raw: dict) -> User:
        """A user as `users.json` keeps them (a file written before a field existed has its default)."""
        fields = {k: v for k, v in raw.items() if k in User.__dataclass_fields__}
        if "data_roots" in fields:
            fields["data_roots"] = tuple(fields["data_roots"])
        if raw.get("admin") and "max_priority" not in raw:
            fields["max_priority"] = None
        return User(**fields)


ADMIN_USER = User(ADMIN, admin=True, max_priority=None)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def find(users: list[User], token: str) -> User | None:
    """The user whose token this is. Every stored hash is compared, each in constant time, so the answer's timing
    says nothing of which hash (or how much of one) matched."""
    presented = hash_token(token).encode()
    found = None
    for user in users:
        if hmac.compare_digest(presented, user.token_sha256.encode()):
            found = user
    return found


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise UserError(f"user name {name!r}: 1 to 64 letters, digits, '_', '.', '@' or '-', starting with a letter "
                        "or digit")
    if name == ADMIN:
        raise UserError(f"user name {ADMIN!r} is the state directory's token (the admin's); choose another name, "
                        "with --admin for another admin")


def check_limit(option: str, value: float | None) -> None:
    if value is not None and not 0 < value < float("inf"):
        raise UserError(f"{option} must be a positive number, got {value:g}")


def read(state_dir: Path) -> list[User]:
    path = state_dir / USERS_FILE
    if not path.exists():
        return []
    return [User.from_dict(u) for u in json.loads(path.read_text())["users"]]


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[list[User]]:
    """The users, to change in place and written back (whole, then renamed) when the block ends; one writer at a
    time (two `token create` at once must not lose one)."""
    with open(state_dir / f"{USERS_FILE}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        users = read(state_dir)
        yield users
        tmp = state_dir / f"{USERS_FILE}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"users": [asdict(u) for u in users]}, f, indent=1)
        tmp.replace(state_dir / USERS_FILE)


@dataclass(frozen=True)
class Limits:
    """What `token create` and `token update` set of a user beside their name and role; a None field of an
    update keeps the user's value (`unset` names the limits an update removes)."""

    max_cpus: float | None = None
    max_gpus: float | None = None
    data_roots: tuple[str, ...] | None = None
    max_queued: int | None = None
    max_priority: int | None = None
    max_storage_bytes: int | None = None
    unset: tuple[str, ...] = ()


def check_limits(limits: Limits) -> Limits:
    """The limits checked, data roots resolved (each an existing directory, never the state directory's)."""
    check_limit("--max-cpus", limits.max_cpus)
    check_limit("--max-gpus", limits.max_gpus)
    check_limit("--max-storage", limits.max_storage_bytes)
    if limits.max_queued is not None and not 0 < limits.max_queued <= 1_000_000:
        raise UserError(f"--max-queued must be 1 to 1000000, got {limits.max_queued}")
    if limits.max_priority is not None and not 0 <= limits.max_priority <= 1_000_000:
        raise UserError(f"--max-priority must be 0 to 1000000, got {limits.max_priority}")
    roots = None
    if limits.data_roots is not None:
        roots = tuple(dict.fromkeys(str(resolve(r)) for r in limits.data_roots))
        for root in roots:
            if not Path(root).is_dir():
                raise UserError(f"--data-root {root}: not a directory")
    return dataclasses.replace(limits, data_roots=roots)


def create(state_dir: Path, name: str, admin: bool = False, max_cpus: float | None = None,
           max_gpus: float | None = None, limits: Limits | None = None) -> str:
    """Add a user; their token (shown once: only its hash is kept)."""
    check_name(name)
    limits = limits or Limits()
    limits = check_limits(dataclasses.replace(limits, max_cpus=limits.max_cpus if max_cpus is None else max_cpus,
                                              max_gpus=limits.max_gpus if max_gpus is None else max_gpus))
    _refuse_state_dir(state_dir, limits.data_roots or ())
    token = new_token()
    with _locked(state_dir) as users:
        if any(u.name == name for u in users):
            raise UserError(f"user {name!r} exists; `trainyard token revoke {name}` first for a new token")
        priority = limits.max_priority if limits.max_priority is not None else (None if admin else 0)
        users.append(User(name, admin, limits.max_cpus, limits.max_gpus, hash_token(token), time.time(),
                          data_roots=limits.data_roots or (), max_queued=limits.max_queued, max_priority=priority,
                          max_storage_bytes=limits.max_storage_bytes))
    return token


def update(state_dir: Path, name: str, limits: Limits) -> User:
    """Change a user's limits and data roots (their token stays); the running service applies them from its next
    request (to jobs submitted from then on, and to admission)."""
    limits = check_limits(limits)
    _refuse_state_dir(state_dir, limits.data_roots or ())
    unknown = set(limits.unset) - _UNSETTABLE
    if unknown:
        raise UserError(f"cannot unset {sorted(unknown)}; one of {sorted(_UNSETTABLE)}")
    with _locked(state_dir) as users:
        index = next((i for i, u in enumerate(users) if u.name == name), None)
        if index is None:
            raise UserError(f"no user {name!r} (`trainyard token list` shows them)")
        changes = {k: v for k, v in dataclasses.asdict(limits).items() if k != "unset" and v is not None}
        changes |= {k: () if k == "data_roots" else None for k in limits.unset}
        users[index] = dataclasses.replace(users[index], **changes)
        return users[index]


_UNSETTABLE = frozenset({"max_cpus", "max_gpus", "data_roots", "max_queued", "max_priority", "max_storage_bytes"})


def _refuse_state_dir(state_dir: Path, roots: tuple[str, ...]) -> None:
    home = resolve(str(state_dir))
    for root in roots:
        path = Path(root)
        if path == home or path.is_relative_to(home) or home.is_relative_to(path):
            raise UserError(f"--data-root {root}: holds or is inside the state directory {home}, which is never data")


def revoke(state_dir: Path, name: str) -> None:
    """Remove a user: their token is refused from the service's next request. Their jobs stay (an admin sees them;
    a user made again with the same name owns them again)."""
    with _locked(state_dir) as users:
        if not any(u.name == name for u in users):
            raise UserError(f"no user {name!r} (`trainyard token list` shows them)")
        users[:] = [u for u in users if u.name != name]


class Registry:
    """The service's view of `users.json`, read at each request (a few hundred bytes) and parsed again when its
    bytes changed: a new or revoked token counts from the next request."""

    def __init__(self, state_dir: Path | None):
        self.path = state_dir / USERS_FILE if state_dir is not None else None
        self._lock = threading.Lock()
        self._seen: bytes = b""
        self._users: list[User] = []

    def users(self) -> list[User]:
        try:
            text = self.path.read_bytes() if self.path is not None else b""
        except FileNotFoundError:
            text = b""
        with self._lock:
            if text != self._seen:
                self._users = [User.from_dict(u) for u in json.loads(text)["users"]] if text else []
                self._seen = text
            return self._users

    def authenticate(self, token: str) -> User | None:
        return find(self.users(), token)

    def quota(self, name: str) -> Quota:
        """A user's quota; none for an admin, or a user no longer there (their jobs were admitted already)."""
        user = next((u for u in self.users() if u.name == name), None)
        return user.quota if user is not None else NO_QUOTA
