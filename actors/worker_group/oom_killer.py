"""Telling a rank the kernel's OOM killer took from any other death.

The kernel's OOM killer (the node full, or a container's memory cgroup at its limit) sends SIGKILL: the rank
dies with no Python error, and Ray's word for it is the one it has for `os._exit` or a segfault ("Worker exit
type: SYSTEM_ERROR ... connection error code 2. End of file. Some common causes include: (1) the process was
killed by the OOM killer ...", seen with ray 2.x for all three; SIGTERM says "SIGTERM"). What tells them apart is
the kernel's own count of its OOM kills, read on the rank's node when the rank is set up (`read_oom_counters`, in
`Worker.setup`) and again after it died (`read_on_node`, a task pinned to that node): a death of that kind on a
node whose count rose is out of memory (`oom_killed`, pure).

Two counts, the most specific one that both readings have deciding:
- the rank's memory cgroup's `oom_kill` (cgroup v2 `memory.events`, which counts its whole subtree; v1
  `memory.oom_control`, summed here over the subtree): only the kills of the rank's container or below;
- the kernel's `oom_kill` in /proc/vmstat (readable unprivileged): every OOM kill on the machine, when no cgroup
  count can be read (another process killed at the same moment as a rank crashed would be blamed on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import ray

CGROUP_ROOT = Path("/sys/fs/cgroup")
READ_TIMEOUT_S = 10.0
"""How long the coordinator waits for the count on a dead rank's node (a node lost never answers)."""


@dataclass(frozen=True)
class OomCounts:
    """One reading of the OOM-kill counts on a node (None: not readable there)."""

    kernel: int | None = None
    """/proc/vmstat's `oom_kill`: every OOM kill since the machine booted."""
    cgroup: int | None = None
    """The `oom_kill` of the rank's memory cgroup and those below it."""
    cgroup_path: str | None = None
    """That cgroup, as /proc/self/cgroup names it: the reading after a death reads the same one."""

    @classmethod
    def of(cls, reading: dict | None) -> OomCounts | None:
        return None if not reading else cls(**reading)


def unexpected_exit(death: str) -> bool:
    """Whether Ray's word for a dead rank fits a SIGKILL: its process exited with no Python error, not by
    `ray.kill` (INTENDED_USER_EXIT), a SIGTERM or its node's loss."""
    return "Worker exit type: SYSTEM_ERROR" in death and "SIGTERM" not in death


def oom_killed(death: str, before: OomCounts | None, after: OomCounts | None) -> str | None:
    """Why a rank that died (`death`: Ray's error for it) was killed by the kernel's OOM killer, or None: it exited
    as a SIGKILL does, and the OOM-kill count of its cgroup rose between the reading at its setup (`before`) and
    the one after its death (`after`); the kernel's count when the cgroup's cannot be read on both."""
    if not unexpected_exit(death) or before is None or after is None:
        return None
    if before.cgroup is not None and after.cgroup is not None and before.cgroup_path == after.cgroup_path:
        if after.cgroup > before.cgroup:
            return (f"the kernel's OOM killer killed it: the oom_kill count of its memory cgroup ({after.cgroup_path}) "
                    f"rose from {before.cgroup} to {after.cgroup}")
        return None
    if before.kernel is not None and after.kernel is not None and after.kernel > before.kernel:
        return (f"the kernel's OOM killer killed it: its node's oom_kill count (/proc/vmstat) rose from "
                f"{before.kernel} to {after.kernel}")
    return None


def read_oom_counters(cgroup_path: str | None = None) -> dict:
    """This node's OOM-kill counts, as a dict for `OomCounts`: the kernel's, and the cgroup's at `cgroup_path`
    (this process's memory cgroup when None)."""
    path = _own_memory_cgroup() if cgroup_path is None else cgroup_path
    return {"kernel": _vmstat_oom_kill(), "cgroup": None if path is None else _cgroup_oom_kill(path),
            "cgroup_path": path}


async def read_on_node(node_id: str, cgroup_path: str | None) -> OomCounts | None:
    """The counts on node `node_id`: read here when this process runs there, else by a task pinned there; None
    when it does not answer in time."""
    if node_id == ray.get_runtime_context().get_node_id():  # no task to start (a second or more on a busy node)
        return OomCounts.of(await asyncio.to_thread(read_oom_counters, cgroup_path))
    return await read_by_task(node_id, cgroup_path)


async def read_by_task(node_id: str, cgroup_path: str | None) -> OomCounts | None:
    """The counts on node `node_id`, read by a task pinned there; None when it does not answer in time."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ref = _read_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
        cgroup_path)
    try:
        return OomCounts.of(await asyncio.wait_for(ref, READ_TIMEOUT_S))
    except (TimeoutError, ray.exceptions.RayError):
        with contextlib.suppress(Exception):  # already finished or failed
            ray.cancel(ref, force=True)
        return None


@ray.remote(num_cpus=0, max_retries=0)
def _read_here(cgroup_path: str | None) -> dict:
    return read_oom_counters(cgroup_path)


def confine_memory(limit_bytes: int, name: str) -> Path:
    """Move this process into a new memory cgroup `name` below its own, limited to `limit_bytes` of new memory, so
    that asking for more gets it killed by the kernel's OOM killer as a full node or container would (the
    `oom_kill_worker` drill). Returns the new cgroup's directory (empty once the process is gone: the caller may
    remove it)."""
    directory = memory_cgroup(limit_bytes, name)
    (directory / "cgroup.procs").write_text(str(os.getpid()))
    return directory


def memory_cgroup(limit_bytes: int, name: str) -> Path:
    """A new memory cgroup `name` below this process's own, limited to `limit_bytes` (a process written to its
    cgroup.procs is in it). Needs a writable cgroup (root, or a delegated subtree; v2 also needs the memory
    controller enabled below this process's own); raises OSError otherwise."""
    directory = child_cgroup(name)
    if directory is None:
        raise PermissionError("no memory cgroup to confine a process in (/proc/self/cgroup names none)")
    directory.mkdir(exist_ok=True)
    if (directory / "memory.max").exists():  # v2
        (directory / "memory.max").write_text(str(limit_bytes))
        with contextlib.suppress(OSError):  # no swap: nothing to limit
            (directory / "memory.swap.max").write_text("0")
    else:
        (directory / "memory.limit_in_bytes").write_text(str(limit_bytes))
        with contextlib.suppress(OSError):  # no swap accounting: nothing to limit
            (directory / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
    return directory


def child_cgroup(name: str) -> Path | None:
    """The directory of the memory cgroup `name` below this process's own (None: it has none)."""
    own = _own_memory_cgroup()
    if own is None:
        return None
    kind, _, path = own.partition(":")
    parent = _v2_dir(path) if kind == "v2" else CGROUP_ROOT / "memory" / path.lstrip("/")
    return None if parent is None else parent / name


def _vmstat_oom_kill() -> int | None:
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except OSError:
        pass
    return None


def _own_memory_cgroup() -> str | None:
    """This process's memory cgroup: "v2:<path>" or "v1:<path>" (v2 where both are mounted, as systemd's
    hybrid layout does, only when it has the memory controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and _v2_dir(path) is not None:
            found["v2"] = path
        elif "memory" in controllers.split(","):
            found["v1"] = path
    for kind in ("v2", "v1"):
        if kind in found:
            return f"{kind}:{found[kind]}"
    return None


def _v2_dir(path: str) -> Path | None:
    for mount in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        directory = mount / path.lstrip("/")
        if (directory / "memory.events").exists():
            return directory
    return None


def _cgroup_oom_kill(cgroup_path: str) -> int | None:
    kind, _, path = cgroup_path.partition(":")
    if kind == "v2":
        events = _v2_dir(path)
        return None if events is None else _field(events / "memory.events", "oom_kill")
    top = CGROUP_ROOT / "memory" / path.lstrip("/")
    if not (top / "memory.oom_control").exists():
        return None
    total = 0  # v1 counts each cgroup's own kills only: the subtree's are summed
    for below, _, _ in os.walk(top):
        total += _field(Path(below) / "memory.oom_control", "oom_kill") or 0
    return total


def _field(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None
