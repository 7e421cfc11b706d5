"""Sharded checkpoints with torch.distributed.checkpoint (DCP): where they live, how they become visible,
how a damaged one is found, and saving and loading one rank's state.

A checkpoint is a directory `<root>/step_<N>` holding the state after N steps: DCP's files (each rank
writes its own shards; DCP keeps one copy of what several ranks hold) and `trainyard.json`, written last,
naming every file with its size and SHA-256 plus the step and the model and optimizer config. It is
written under a temporary name and renamed once complete, so a directory without the temporary suffix is
a whole checkpoint, and `latest_valid` skips any whose files do not match their manifest (truncated,
corrupted, missing) in favour of the one before.

What is saved: every parameter under its unsharded model's name (`blocks.3.attn.q.weight`, experts by
their global index), tensor-parallel ones as DTensors, and each parameter's AdamW moments under the same
name in the parameter's shape. DCP reshards on load: a checkpoint written at (dp=2, tp=2) loads at
(pp=2) or any other layout, since every layout names and shapes its parameters the same way. The step
count is all the trainer state the next step depends on: the data order and the learning rate are
functions of (seed, step), and nothing else is random.

Written around DCP rather than through `get_state_dict`/`set_state_dict` because a rank's model is several
pipeline chunks and, with ZeRO-1, its optimizer holds pieces of parameters (see `parallel.runtime.rank_state`'s
`checkpoint_state`), neither of which those functions take. With ZeRO-2/3 the parameters and their moments
are FSDP2's DTensors, sharded over dp (and tp): DCP saves them under the same names and unsharded shapes, so
a checkpoint written at zero=3 loads at zero=0 dp=1 and the reverse.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

# torch.distributed.checkpoint is imported by the functions that save and load (in the ranks): the coordinator
# and the service use the file-level half (steps, manifests, verification) and must not pay torch's import.

MANIFEST = "trainyard.json"
MODEL_FILE = "model.safetensors"
"""The consolidated model a finished job exports (`parallel.io.export`); named here, where the service reads it
without importing torch."""
_PREFIX = "step_"
_TMP = ".tmp"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:09d}"


def committed_steps(root: Path) -> list[int]:
    """Steps of the complete (renamed) checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        name = d.name
        if d.is_dir() and name.startswith(_PREFIX) and not name.endswith(_TMP) and name[len(_PREFIX):].isdigit():
            steps.append(int(name[len(_PREFIX):]))
    return sorted(steps)


def verify(directory: Path, hashes: bool = True) -> str | None:
    """None if every file the manifest names is there with its size and hash; else what is wrong.
    `hashes=False` checks names and sizes only (milliseconds, where hashing tens of GB takes minutes): what
    the service checks on paths that must not block; the coordinator hashes in a thread before loading."""
    try:
        files = read_manifest(directory)["files"]
        files = {str(name): (int(size), str(digest)) for name, (size, digest) in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a manifest of another shape too
        return f"no readable manifest ({type(e).__name__}: {e})"
    for name, (size, digest) in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
        if hashes and _sha256(path) != digest:
            return f"{name} does not match its checksum"
    return None


@dataclass(frozen=True)
class Found:
    step: int
    directory: Path
    skipped: tuple[str, ...]
    """Later checkpoints passed over, each with what was wrong with it."""


def latest_valid(root: Path, at_most: int | None = None, hashes: bool = True) -> Found | None:
    """The newest complete, intact checkpoint with step <= at_most (any step when None); `hashes`: as `verify`."""
    skipped: list[str] = []
    for step in reversed(committed_steps(root)):
        if at_most is not None and step > at_most:
            continue
        problem = verify(step_dir(root, step), hashes)
        if problem is None:
            return Found(step=step, directory=step_dir(root, step), skipped=tuple(skipped))
        skipped.append(f"step {step}: {problem}")
    return None


def read_manifest(directory: Path) -> dict:
    """A checkpoint's manifest: its step, the job it records (`info`) and each file's size and sha256."""
    return json.loads((directory / MANIFEST).read_text())


def prune(root: Path, keep: int, step: int) -> None:
    """After checkpoint `step` is committed: delete all but the newest `keep` checkpoints up to it, every
    checkpoint after it, and the temporary directories of older saves (left by a crash); called by the writer
    right after a commit, when no other save is under way. A checkpoint after the one just written is from an
    attempt a recovery rolled back (damaged, or committed ahead of its metrics row): no job goes on from it, and
    counting it among the newest would delete the one just written (`keep: 1`) or the intact ones before it."""
    committed = committed_steps(root)
    kept = [s for s in committed if s <= step]
    for stale in [s for s in committed if s > step] + kept[:-keep]:
        shutil.rmtree(step_dir(root, stale), ignore_errors=True)
    for d in root.glob(f"{_PREFIX}*{_TMP}"):
        name = d.name[len(_PREFIX):-len(_TMP)]
        if name.isdigit() and int(name) < step:
            shutil.rmtree(d, ignore_errors=True)


class CheckpointWriteError(RuntimeError):
    """Checkpoint `step` could not be written (a full file system, a permission, a write error): every rank of
    the save raises it alike, and no checkpoint before it is touched, so the job can go on and try again."""

    def __init__(self, step: int, error: str):
        super().__init__(f"the checkpoint of step {step} was not written: {error}")
        self.step = step


def save(state: dict, root: Path, step: int, info: dict, group: dist.ProcessGroup | None,
         is_writer: bool, from_lowest_rank: bool = False) -> None:
    """Write `state` (this rank's part) as checkpoint `step` and, on the writer rank, commit it.

    Collective over `group`. `info` goes into the manifest (config, anything a resuming job checks).
    `from_lowest_rank`: a tensor that several ranks hold is written from the lowest of them (data-parallel
    replica 0), not from whichever balances the writes (`_planner`). A write that fails anywhere raises
    `CheckpointWriteError` on every rank (the ranks agree on it: one rank raising alone would leave the others
    waiting in the next collective)."""
    tmp = _fresh_tmp(root, step, group, is_writer)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        try:
            dcp.save(state, checkpoint_id=tmp, process_group=group, planner=_planner(from_lowest_rank))
        except CheckpointException as e:  # DCP gathers every rank's write errors and raises them on all ranks alike
            raise CheckpointWriteError(step, _write_errors(e)) from e
        _agree(step, group, _attempt(lambda: commit(tmp, step_dir(root, step), {**info, "step": step})
                                     if is_writer else None))
    except CheckpointWriteError:
        if is_writer:  # every rank is done with it: the space its parts took is given back for the next try
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _attempt(write: Callable[[], object]) -> str | None:
    """What went wrong writing on this rank (an OSError: no space, no permission, an I/O error), else None."""
    try:
        write()
    except OSError as e:
        return _first_line(e)
    return None


def _agree(step: int, group: dist.ProcessGroup | None, error: str | None) -> None:
    """Every rank learns whether any rank's write failed, and all raise `CheckpointWriteError` if one did."""
    errors = [error]
    if group is not None:
        import torch.distributed as dist

        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    found = next((e for e in errors if e is not None), None)
    if found is not None:
        raise CheckpointWriteError(step, found)


def _write_errors(error: BaseException) -> str:
    """The ranks' own errors inside DCP's CheckpointException (its message is only the ranks' list)."""
    failures = getattr(error, "failures", {})  # rank -> (exception, its traceback)
    return "; ".join(f"rank {rank}: {_first_line(pair[0])}" for rank, pair in sorted(failures.items())) \
        or _first_line(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _planner(from_lowest_rank: bool):
    """DCP's default save planner. Its dedup writes each replicated tensor once, from the rank that balances the
    writes: right when the replicas hold equal copies, a mix of replicas when they may not (local_sgd, diloco)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    return DefaultSavePlanner(dedup_save_to_lowest_rank=from_lowest_rank)


def start_async_save(state: dict, root: Path, step: int, info: dict, group: dist.ProcessGroup | None,
                     is_writer: bool, from_lowest_rank: bool = False) -> Callable[[], None]:
    """Begin saving `state` in the background (DCP async save: the state is staged, then written by a
    thread, which also commits it); returns `finish()`, which waits until it is committed and raises what
    went wrong. Collective over `group`."""
    tmp = _fresh_tmp(root, step, group, is_writer)
    import torch.distributed.checkpoint as dcp

    pending = dcp.async_save(state, checkpoint_id=tmp, process_group=group, planner=_planner(from_lowest_rank))
    future = pending if isinstance(pending, Future) else pending.upload_completion  # newer torch's AsyncSaveResponse
    done, errors = threading.Event(), []

    def commit_when_written(written) -> None:
        try:
            written.result()
            if is_writer:
                commit(tmp, step_dir(root, step), {**info, "step": step})
        except BaseException as e:  # noqa: BLE001 - handed to finish(), in the step loop's thread
            errors.append(e)
        finally:
            done.set()

    future.add_done_callback(commit_when_written)

    def finish() -> None:
        done.wait()
        from torch.distributed.checkpoint.api import CheckpointException

        failed = errors[0] if errors else None
        if isinstance(failed, CheckpointException):
            _agree(step, group, _write_errors(failed))
        if failed is not None and not isinstance(failed, Exception):
            raise failed  # not a write error (KeyboardInterrupt, SystemExit)
        _agree(step, group, None if failed is None else _first_line(failed))

    return finish


def _fresh_tmp(root: Path, step: int, group: dist.ProcessGroup | None, is_writer: bool) -> Path:
    """The empty temporary directory a save writes into (made by the writer while the others wait: they learn
    whether it could be made)."""
    tmp = step_dir(root, step).with_name(step_dir(root, step).name + _TMP)

    def make() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    _agree(step, group, _attempt(make) if is_writer else None)
    return tmp


def load(state: dict, directory: Path, group: dist.ProcessGroup | None) -> None:
    """Fill `state`'s tensors in place from the checkpoint, resharding to this layout. Collective."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=directory, process_group=group)


def commit(tmp: Path, final: Path, info: dict) -> None:
    """Write the manifest (every file's size and hash), then make the checkpoint visible by renaming it."""
    files = {p.name: [p.stat().st_size, _sha256(p)] for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({**info, "files": files}, indent=1))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)  # a retried save of the same step
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
