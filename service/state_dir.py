"""The state directory (`~/.trainyard` by default): job store, API token, and where the server listens."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

DEFAULT_STATE_DIR = Path("~/.trainyard")


def resolve(state_dir: str | Path | None) -> Path:
    path = Path(state_dir).expanduser() if state_dir else DEFAULT_STATE_DIR.expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_private(state_dir: Path) -> None:
    """The state directory and the files of it a user could read otherwise (the store, its journal) readable by
    the service's account only (files made from now on are, by the service's umask)."""
    state_dir.chmod(0o700)
    for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm", "token", "users.json"):
        path = state_dir / name
        if path.exists():
            path.chmod(0o600)


def load_or_create_token(state_dir: Path) -> str:
    """The API's bearer token, generated on first start and readable by its owner only (mode 0600)."""
    path = state_dir / "token"
    if path.exists():
        return path.read_text().strip()
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def new_token() -> str:
    """32 random bytes, URL-safe, never starting with '-' (a command line would read it as an option)."""
    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token


def read_token(state_dir: Path) -> str | None:
    path = state_dir / "token"
    return path.read_text().strip() if path.exists() else None


def write_server_info(state_dir: Path, url: str) -> None:
    (state_dir / "server.json").write_text(json.dumps({"url": url}))


def read_server_url(state_dir: Path) -> str | None:
    path = state_dir / "server.json"
    return json.loads(path.read_text())["url"] if path.exists() else None
