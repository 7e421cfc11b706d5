"""Who may read and write which path: every path a spec names is resolved (`~`, `..`, symlinks) and checked here,
against its owner, in one place.

A user's job reads only under the user's data roots (`trainyard token create NAME --data-root DIR`), their own
uploads (`POST /api/files`) and their own jobs' outputs; an admin's job reads any path but the state directory's.
The state directory (the store, the tokens, every user's uploads, checkpoints and models) is never data, for
anyone, but for a user's own uploads and own jobs' outputs there. A directory is read only if nothing under it
leads elsewhere (a symlink out of the allowed areas). A checkpoint directory (`checkpoint.path`) must lie under a
user's data roots (an admin's: anywhere outside the state directory).

Every refusal is one answer (`NOT_READABLE`, naming the field), whether the path exists or not: a user learns
nothing of a path outside their areas, not even that it is there.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.parallel.config import RuleError

NOT_READABLE = ("no such file or directory among the paths this user may read (their data roots, their uploads, "
                "their jobs' outputs)")
NOT_WRITABLE = "not under this user's data roots (a checkpoint directory must be; null: the service's own area)"
MAX_DIRECTORY_ENTRIES = 200_000
"""Most files and folders a directory a spec names may hold (each is checked for a link out of the areas)."""

READ_FIELDS = (("data", "path"), ("data", "val_path"), ("init_from", "adapter"), ("init_from", "hf"))
"""The (section, field) pairs of a spec that name a path a job reads; `data.sources[].path` too."""


@dataclass(frozen=True)
class Owner:
    """Who a request acts for: a user's name, whether an admin, and their data roots."""

    name: str
    admin: bool = False
    data_roots: tuple[str, ...] = ()


def resolve(path: str) -> Path:
    """`path` as the service would open it: `~` expanded, relative to the working directory, `..` and every
    symlink resolved (a missing tail is kept as written)."""
    return Path(os.path.realpath(os.path.expanduser(path)))


def _inside(path: Path, area: Path) -> bool:
    return path == area or path.is_relative_to(area)


class Access:
    """The areas of the service's own files (`state_dir`, and `data_dir` where elsewhere), and each user's own
    places within them: `uploads/<user>/`, and `models/<job>/`, `checkpoints/<job>/` of the jobs `owns` says
    are theirs."""

    def __init__(self, state_dir: Path, data_dir: Path | None = None,
                 owns: Callable[[str, str], bool] = lambda _job, _user: False):
        self.private = tuple(dict.fromkeys(resolve(str(d)) for d in (state_dir, data_dir or state_dir)))
        self.data_dir = resolve(str(data_dir or state_dir))
        self.uploads_root = self.data_dir / "uploads"
        self.owns = owns

    def uploads_of(self, user: str) -> Path:
        return self.uploads_root / user

    # --- the rule ----------------------------------------------------------------------------------------------

    def may_read(self, owner: Owner, path: Path) -> bool:
        """Whether `owner`'s job may read `path` (resolved, existing)."""
        if any(_inside(path, area) for area in self.private):
            return self._own_output(owner, path)
        if owner.admin:
            return True
        return any(_inside(path, resolve(root)) for root in owner.data_roots)

    def _own_output(self, owner: Owner, path: Path) -> bool:
        if _inside(path, self.uploads_of(owner.name)):
            return True
        for folder in ("models", "checkpoints"):
            area = self.data_dir / folder
            if path != area and _inside(path, area):
                job_id = path.relative_to(area).parts[0]
                return self.owns(job_id, owner.name)
        return False

    def readable(self, owner: Owner, field: str, path: str) -> str:
        """`path` resolved, if `owner` may read it and everything under it; else RuleError(field, NOT_READABLE)."""
        try:
            resolved = resolve(path)
            ok = resolved.exists() and self.may_read(owner, resolved) and self._tree_readable(owner, resolved)
        except (OSError, ValueError):  # a name too long, a NUL byte, no permission: as a missing path
            ok = False
        if not ok:
            raise RuleError(field, NOT_READABLE)
        return str(resolved)

    def _tree_readable(self, owner: Owner, top: Path) -> bool:
        """Nothing under directory `top` resolves outside what `owner` may read: each link's target is readable,
        and a linked directory is checked as a tree of its own (once; a file: nothing to check)."""
        pending, seen, count = [top], {top}, 0
        while pending:
            for entry in _entries(pending.pop()):
                count += 1
                if count > MAX_DIRECTORY_ENTRIES:
                    return False
                if not entry.is_symlink():
                    continue
                target = resolve(str(entry))
                if not self.may_read(owner, target):
                    return False
                if target.is_dir() and target not in seen:
                    seen.add(target)
                    pending.append(target)
        return True

    def writable(self, owner: Owner, field: str, path: str) -> str:
        """A directory `owner`'s job may write (create) under: a user's data roots, anywhere outside the service's
        own areas for an admin; resolved. Else RuleError(field, NOT_WRITABLE)."""
        try:
            resolved = resolve(path)
        except (OSError, ValueError):
            raise RuleError(field, NOT_WRITABLE) from None
        if any(_inside(resolved, area) or _inside(area, resolved) for area in self.private):
            raise RuleError(field, NOT_WRITABLE)
        if not owner.admin and not any(_inside(resolved, resolve(root)) for root in owner.data_roots):
            raise RuleError(field, NOT_WRITABLE)
        return str(resolved)

    # --- a spec ------------------------------------------------------------------------------------------------

    def confine(self, owner: Owner, spec: Any) -> Any:
        """A submitted spec (as parsed JSON, not validated yet) with every path it names resolved and checked;
        RuleError naming the first field refused. Values of the wrong type are left for validation to name."""
        if not isinstance(spec, dict):
            return spec
        out = copy.deepcopy(spec)
        for section, field in READ_FIELDS:
            part = out.get(section)
            if isinstance(part, dict) and isinstance(part.get(field), str):
                part[field] = self.readable(owner, f"{section}.{field}", part[field])
        data = out.get("data")
        sources = data.get("sources") if isinstance(data, dict) else None
        if isinstance(sources, list):
            for i, source in enumerate(sources):
                if isinstance(source, dict) and isinstance(source.get("path"), str):
                    source["path"] = self.readable(owner, f"data.sources.{i}.path", source["path"])
        ckpt = out.get("checkpoint")
        if isinstance(ckpt, dict) and isinstance(ckpt.get("path"), str):
            ckpt["path"] = self.writable(owner, "checkpoint.path", ckpt["path"])
        return out


def _entries(top: Path) -> Iterator[Path]:
    """Every file and folder under directory `top`, links not followed (a link is checked where it leads)."""
    for root, dirs, files in os.walk(top, followlinks=False):
        for name in dirs + files:
            yield Path(root) / name
