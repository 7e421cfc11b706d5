"""A user's uploads (`POST /api/files`, `trainyard upload`): files and prepared dataset directories a spec may then
name, since users have no shell on the server; and what a user's files take (uploads, checkpoints, models)
against their storage quota.

An upload is a folder of its own, `uploads/<user>/<id>/`, holding one file or one directory (`<id>/<name>`): the
path a spec names. The body is streamed to disk in chunks, never held in memory, and stops at the size limit
(the smaller of the per-upload limit and what the user's storage quota leaves). A directory arrives as a tar
(`archive=tar`), extracted with regular files and folders only (no links, devices, absolute names or `..`), so
nothing in it leads out of it. A half-written upload is never listed: it is written under a dot-named folder
and renamed into place once whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from trainyard.parallel.config import RuleError

DEFAULT_MAX_UPLOAD_BYTES = 16 * 2**30
"""One upload's most bytes (`trainyard serve --max-upload-bytes`); a user's storage quota may leave less."""
INFO_FILE = ".upload.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_ID = re.compile(r"[0-9a-f]{12}")


class UploadTooLarge(Exception):
    """The body went past the limit (a 413); nothing of it is kept."""


class UploadNotFound(Exception):
    """No such upload of this user (another user's answers the same)."""


@dataclass(frozen=True)
class Upload:
    upload_id: str
    name: str
    path: str
    """What a spec names (`data.path`, `init_from.hf`, ...)."""
    kind: str
    """file | directory"""
    bytes: int
    created_at: float


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name) or name.endswith(".tmp"):
        raise RuleError("name", "1 to 128 letters, digits, '_', '.' or '-', starting with a letter or digit")


class Uploads:
    """Every user's uploads under `root` (`<data dir>/uploads`)."""

    def __init__(self, root: Path):
        self.root = root

    def folder(self, user: str) -> Path:
        return self.root / user

    def sweep_partial(self) -> None:
        """Remove what uploads cut off by a killed service left (their dot-named folders); only at start, when no
        upload is in progress."""
        for partial in self.root.glob("*/.*.tmp"):
            shutil.rmtree(partial, ignore_errors=True)

    async def receive(self, user: str, name: str, chunks: AsyncIterator[bytes], limit: int,
                      archive: bool = False) -> Upload:
        """Stream `chunks` to a new upload of `user`'s named `name` (a tar of a directory if `archive`);
        UploadTooLarge past `limit` bytes, RuleError for a tar that is not one of plain files and folders."""
        check_name(name)
        upload_id = uuid.uuid4().hex[:12]
        tmp = self.folder(user) / f".{upload_id}.tmp"
        tmp.mkdir(parents=True, mode=0o700)
        try:
            received = tmp / (".archive.tar" if archive else name)
            size = 0
            with open(received, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise UploadTooLarge(f"the upload is larger than the {limit} bytes this user may upload now "
                                             "(the per-upload limit, or what their storage quota leaves)")
                    f.write(chunk)
            if archive:
                _extract(received, tmp / name, limit)
                received.unlink()
            kind = "directory" if archive else "file"
            total = tree_bytes(tmp)
            upload = Upload(upload_id, name, str(self.folder(user) / upload_id / name), kind, total, time.time())
            (tmp / INFO_FILE).write_text(json.dumps(asdict(upload)))
            tmp.rename(self.folder(user) / upload_id)
            return upload
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def list(self, user: str) -> list[Upload]:
        folder = self.folder(user)
        if not folder.is_dir():
            return []
        out = []
        for entry in sorted(folder.iterdir()):
            info = entry / INFO_FILE
            if _ID.fullmatch(entry.name) and info.is_file():
                out.append(Upload(**json.loads(info.read_text())))
        return sorted(out, key=lambda u: u.created_at)

    def delete(self, user: str, upload_id: str) -> None:
        folder = self.folder(user) / upload_id
        if not _ID.fullmatch(upload_id) or not (folder / INFO_FILE).is_file():
            raise UploadNotFound(upload_id)
        shutil.rmtree(folder)


def _extract(archive: Path, out: Path, limit: int) -> None:
    """A tar of plain files and folders into `out`; RuleError naming what it refuses (links, devices, names that
    leave `out`), UploadTooLarge when its files add up past `limit` bytes."""
    out.mkdir(mode=0o700)
    total = 0
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if Path(member.name).is_absolute() or ".." in parts or not (member.isfile() or member.isdir()):
                    raise RuleError("archive", "a directory upload is a tar of plain files and folders, with relative "
                                               "names inside it (no links, devices, absolute names or '..')")
                total += member.size
                if total > limit:
                    raise UploadTooLarge(f"the directory's files add up to more than the {limit} bytes this user may "
                                         "upload now")
                target = out.joinpath(*parts) if parts else out
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True, mode=0o700)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                source = tar.extractfile(member)
                assert source is not None  # a regular file's
                with source, open(target, "wb") as f:
                    shutil.copyfileobj(source, f)
    except tarfile.TarError:
        raise RuleError("archive", "not a tar archive (`trainyard upload DIR` sends one)") from None


def tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (a file: its size; links not followed; missing: 0)."""
    if path.is_symlink() or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with_path = Path(root) / name
            if not with_path.is_symlink():
                total += with_path.stat().st_size
    return total


def storage_used(paths: Iterable[Path]) -> int:
    """What the user's files take: the bytes under each of `paths` (their uploads folder, their jobs' checkpoint
    and model folders)."""
    return sum(tree_bytes(p) for p in paths)
