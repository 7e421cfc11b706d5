"""Where the Tinker-compatible API's saved state lives, and which of it a caller may name: every training run id and
`tinker://` path resolves here, against its owner, in one place.

The layout, in the service's data directory beside the jobs' checkpoints and models: `tinker/<user>/<run id>/` per
training run (a training client's model id), holding `run.json` (what the run was created from) and
`weights/<name>/` per checkpoint `save_state` wrote: a DCP checkpoint directory as a job's (`step_<N>/` with its
manifest, `parallel.io.checkpoint`). Its path is `tinker://<run id>/weights/<name>`, the SDK's form
(`tinker.types.ParsedCheckpointTinkerPath`): the run, then the checkpoint's id (`weights/<name>`).

Only the caller's own folder is ever looked in, so another user's run or path answers as a missing one
(`CheckpointNotFound`, naming the field) exactly as one that never was. An id, name or path that cannot be one is a
`RuleError` naming the field. Neither quotes what was given. No torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from trainyard.parallel.config import RuleError
from trainyard.parallel.io import checkpoint
from trainyard.service.errors import CheckpointNotFound

PREFIX = "tinker://"
KINDS = {"weights": "training"}
"""A checkpoint id's first part -> the SDK's checkpoint type (sampler and external weights are not served yet)."""
RUN_FILE = "run.json"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_PATH_FORM = "a tinker path is tinker://<training run id>/weights/<name>"


@dataclass(frozen=True)
class Ref:
    """A checkpoint of a training run: `kind` (`weights`) and its `name`."""

    run_id: str
    kind: str
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"{PREFIX}{self.run_id}/{self.checkpoint_id}"

    @property
    def checkpoint_type(self) -> str:
        return KINDS[self.kind]


def check_run_id(run_id: str, field: str) -> str:
    if not isinstance(run_id, str) or not _ID.fullmatch(run_id):
        raise RuleError(field, "not a training run id (a training client's model id)")
    return run_id


def check_name(name: str | None, field: str = "path") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RuleError(field, "a checkpoint's name is 1 to 128 letters, digits, '_', '.' or '-', starting with a "
                               "letter or digit")
    return name


def ref_of(run_id: str, checkpoint_id: str, field: str = "checkpoint_id") -> Ref:
    """The checkpoint `checkpoint_id` (`weights/<name>`) of run `run_id`; RuleError naming `field` otherwise."""
    check_run_id(run_id, field)
    kind, _, name = checkpoint_id.partition("/") if isinstance(checkpoint_id, str) else ("", "", "")
    if kind not in KINDS:
        raise RuleError(field, "not a checkpoint id of a training run (weights/<name>; sampler and external "
                               "weights are not served)")
    return Ref(run_id, kind, check_name(name, field))


def parse(path: str, field: str = "path") -> Ref:
    """A `tinker://` path; RuleError naming `field` when it cannot be one."""
    if not isinstance(path, str) or not path.startswith(PREFIX) or path.count("/") != 4:
        raise RuleError(field, _PATH_FORM)
    run_id, kind, name = path[len(PREFIX):].split("/")
    try:
        return ref_of(run_id, f"{kind}/{name}", field)
    except RuleError:
        raise RuleError(field, _PATH_FORM) from None


class TinkerPaths:
    """Every user's Tinker state under `root` (`<data dir>/tinker`)."""

    def __init__(self, root: Path):
        self.root = root

    def user_root(self, user: str) -> Path:
        return self.root / user

    def run_dir(self, user: str, run_id: str, field: str = "training_run_id") -> Path:
        """Where `user`'s run `run_id` keeps its files (whether or not it has any yet)."""
        return self.user_root(user) / check_run_id(run_id, field)

    def checkpoint_dir(self, user: str, ref: Ref) -> Path:
        return self.run_dir(user, ref.run_id) / ref.kind / ref.name

    def existing_run(self, user: str, run_id: str, field: str = "training_run_id") -> Path:
        """`user`'s run `run_id` that saved state; CheckpointNotFound naming `field` otherwise."""
        directory = self.run_dir(user, run_id, field)
        if not (directory / RUN_FILE).is_file():
            raise CheckpointNotFound(field)
        return directory

    def existing(self, user: str, ref: Ref, field: str = "path") -> Path:
        """The directory of `user`'s checkpoint `ref` holding a committed checkpoint; CheckpointNotFound naming `field`
        otherwise (another user's, or none)."""
        directory = self.checkpoint_dir(user, ref)
        if not checkpoint.committed_steps(directory):
            raise CheckpointNotFound(field)
        return directory

    def runs(self, user: str) -> list[str]:
        """The ids of `user`'s runs that saved state."""
        folder = self.user_root(user)
        if not folder.is_dir():
            return []
        return sorted(d.name for d in folder.iterdir() if _ID.fullmatch(d.name) and (d / RUN_FILE).is_file())

    def checkpoints(self, user: str, run_id: str) -> list[Ref]:
        """`user`'s checkpoints of run `run_id` holding a committed checkpoint, by name."""
        out = []
        for kind in KINDS:
            folder = self.run_dir(user, run_id) / kind
            if folder.is_dir():
                out += [Ref(run_id, kind, d.name) for d in sorted(folder.iterdir())
                        if _NAME.fullmatch(d.name) and checkpoint.committed_steps(d)]
        return out
