"""Starting (embedded) or joining (`--ray-address`) the Ray cluster, and reading what it holds.

The embedded cluster advertises more logical CPUs than the machine has cores (at least
`MIN_EMBEDDED_CPUS`): a laptop can then run a dp=4 CPU job on two cores. Ray CPUs are a scheduling
token here, not a promise of a free core; each worker still sets its torch thread count from its request.

A service that is killed (SIGKILL, OOM) leaves its embedded Ray's daemons (GCS, raylet, dashboard, and the
workers under them) behind as orphans that hold memory and ports. So the service records their process ids
in its state directory once Ray is up (`record_embedded_processes`), and the next start kills whatever of
them still runs (`remove_orphans`) before it starts a new cluster. Processes are read from /proc (Linux);
elsewhere this is skipped. Each is known by pid and start time, so a reused pid is never killed.

The embedded cluster's processes run in a process group of their own. A signal to the service's process
group (systemd's default `KillMode=control-group` sends SIGTERM to every process, `kill -- -PGID` to the
group) then reaches the service alone, which stops its jobs with a final checkpoint and shuts Ray down as
after a plain SIGTERM; before, the GCS died first and the shutdown waited 60 s for it and exited 1. Ray does
the same on Windows where the kernel kills a daemon with its parent (`ConsolePopen`); on Linux it does not,
so `connect` asks for it while `ray.init` starts the daemons. The daemons still die with the service
(Ray's kernel fate-sharing, PR_SET_PDEATHSIG), so nothing outlives it.

The embedded cluster also starts its workers at nice 0 (`RAY_worker_niceness`, which Ray Jobs sets for
its drivers too) instead of Ray's default 15: the workers are the training, and at nice 15 they lose the
cores to the raylet, GCS, dashboard and API server of the same machine. A cluster that is joined keeps
its own setting.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from trainyard.actors.naming import NAMESPACE
from trainyard.parallel.plan import ClusterResources, NodeResources

log = logging.getLogger("trainyard.ray")

MIN_EMBEDDED_CPUS = 8

GPU_MEMORY_GIB = {
    "A100": 80, "A100-40G": 40, "A100-80G": 80, "H100": 94, "H200": 141, "H20": 96, "B200": 192, "B300": 288,
    "GB200": 192, "GB300": 288, "L4": 24, "L40S": 48, "A10G": 24, "T4": 16, "V100": 32, "P100": 16, "P4": 8,
    "K80": 12, "RTX-PRO-6000": 96,
}
"""Memory of one GPU by the name Ray gives it in the node resource `accelerator_type:<name>` (Ray reports no
GPU memory). Where one name covers several sizes (an A100 has 40 or 80 GiB, an H100 80 or 94) the table holds
the largest, so the memory check refuses only jobs that fit none of them; an unknown name counts as unknown."""


@dataclass(frozen=True)
class RayInfo:
    address: str
    dashboard_url: str | None
    embedded: bool


def connect(address: str | None = None, num_cpus: int | None = None, dashboard: bool = True,
            object_store_memory: int | None = None) -> RayInfo:
    """Join the cluster at `address`, or start an embedded one with the dashboard on 127.0.0.1."""
    if ray.is_initialized():  # e.g. tests, or a program embedding the service
        ctx = ray.get_runtime_context()
        return RayInfo(address=ctx.gcs_address, dashboard_url=_dashboard_url(), embedded=False)
    if address:
        ctx = ray.init(address=address, namespace=NAMESPACE)
        return RayInfo(address=address, dashboard_url=_url(ctx.dashboard_url), embedded=False)
    os.environ.setdefault("RAY_worker_niceness", "0")  # read by the raylet that ray.init starts
    # Token auth on (a process that reaches the cluster's ports without the token, in ~/.ray, the service
    # account's, runs nothing on it): `trainyard serve` sets RAY_AUTH_MODE=token before Ray is imported
    # (`cli.main`), which Ray reads once, at its import; set here after that import, the daemons would
    # require the token and this driver would not send it. Test fixtures alone set it to disabled.
    with _daemons_in_their_own_process_group(), agent_port_clear_of_other_clusters():
        ctx = ray.init(
            address="local",  # a cluster of its own, even where a `ray start` of someone else's runs here
            num_cpus=num_cpus or max(os.cpu_count() or 1, MIN_EMBEDDED_CPUS),
            namespace=NAMESPACE,
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            object_store_memory=object_store_memory,
        )
    return RayInfo(address=ctx.address_info["gcs_address"], dashboard_url=_url(ctx.dashboard_url), embedded=True)


@contextlib.contextmanager
def _daemons_in_their_own_process_group() -> Iterator[None]:
    """While it lasts, every process Ray starts (GCS, raylet, dashboard; the raylet's workers follow it) gets
    a process group of its own. Only where the kernel kills them with their parent (fate-sharing), so that a
    killed service still takes them along; through `ray._private.services.ConsolePopen`, the class Ray spawns
    its daemons with (private: if it ever moves, the daemons simply stay in the service's group)."""
    services = getattr(getattr(ray, "_private", None), "services", None)
    fate_sharing = sys.platform.startswith("linux") and ray._private.utils.detect_fate_sharing_support()
    if getattr(services, "ConsolePopen", None) is None or not fate_sharing:
        yield
        return
    with _constructed_with(services, "ConsolePopen", process_group=0):
        yield


@contextlib.contextmanager
def agent_port_clear_of_other_clusters() -> Iterator[None]:
    """While it lasts, a cluster that `ray.init` starts gives its dashboard agent any free port when the fixed
    default (52365) is taken, as it is by any other Ray running on the machine (a `ray start`, another service,
    a test session's). `ray.init` has no argument for that port, and on a taken one the agent retried for 3.4 s,
    which the raylet, and so the service's start, waited for, and then ran without its HTTP server: Ray's log API
    then answered "Agent for node id ... doesn't exist", and `trainyard logs` had no lines. Through
    `ray._private.parameter.RayParams`, the class `ray.init` describes a new node with (private: if it moves,
    the port stays Ray's default, as before). The agent's other (gRPC) port is random already."""
    parameter = getattr(getattr(ray, "_private", None), "parameter", None)
    default = getattr(getattr(ray, "_private", None), "ray_constants", None)
    port = getattr(default, "DEFAULT_DASHBOARD_AGENT_LISTEN_PORT", None)
    if getattr(parameter, "RayParams", None) is None or port is None or _port_free(port):
        yield
        return
    with _constructed_with(parameter, "RayParams", dashboard_agent_listen_port=None):  # Ray's start binds port 0
        yield


@contextlib.contextmanager
def _constructed_with(owner: object, name: str, **defaults: object) -> Iterator[None]:
    """While it lasts, the class `owner.name` (one of Ray's private ones, looked up at each use) is a subclass
    whose constructor takes `defaults` for the keyword arguments its caller does not pass."""
    original: type[Any] = getattr(owner, name)

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        original.__init__(self, *args, **{**defaults, **kwargs})

    # built with type(): a class statement cannot name a base known only at run time to the type checker
    setattr(owner, name, type(original.__name__, (original,), {"__init__": __init__}))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def cluster_resources() -> ClusterResources:
    """Total CPUs, GPUs and memory of every live node (capacity, not what is free now)."""
    nodes = [
        NodeResources(cpus=n["Resources"].get("CPU", 0.0), gpus=n["Resources"].get("GPU", 0.0),
                      memory=n["Resources"].get("memory", 0.0), gpu_memory=gpu_memory(n["Resources"]))
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return ClusterResources(nodes=tuple(nodes))


def gpu_memory(resources: dict[str, float]) -> float:
    """Bytes of one of the node's GPUs, from its `accelerator_type:<name>` resource (0: no GPU or unknown)."""
    prefix = "accelerator_type:"
    sizes = [GPU_MEMORY_GIB.get(key[len(prefix):], 0) for key in resources if key.startswith(prefix)]
    return float(max(sizes, default=0) * 2**30) if resources.get("GPU", 0) > 0 else 0.0


def free_resources() -> list[dict[str, float]]:
    """What each live node has free right now (CPU, GPU), for the admission loop's fit check.

    Ray has no public per-node view of free resources (`ray.available_resources()` sums the nodes, and a
    bundle must fit on one node), so this reads the GCS through `ray._private.state`; if that ever moves,
    the cluster-wide sum stands in as one node: admission then still never over-commits, because the
    placement group itself is the real reservation and is given up when it is not ready at once.
    """
    try:
        per_node = ray._private.state.available_resources_per_node().values()
    except Exception:  # noqa: BLE001 - private API: fall back to the public aggregate
        per_node = [ray.available_resources()]
    return [{"CPU": r.get("CPU", 0.0), "GPU": r.get("GPU", 0.0)} for r in per_node]


def _dashboard_url() -> str | None:
    try:
        return _url(ray.worker.get_dashboard_url())
    except Exception:  # noqa: BLE001 - no dashboard in this cluster
        return None


def _url(address: str | None) -> str | None:
    if not address:
        return None
    return address if address.startswith("http") else f"http://{address}"


def record_embedded_processes(path: Path) -> None:
    """Write this process's id and its descendants' (the embedded Ray) to `path`, each with its start time."""
    me = os.getpid()
    processes = [(pid, _start_time(pid)) for pid in [me, *descendants(me)]]
    path.write_text(json.dumps({"owner": processes[0], "processes": processes[1:]}))


def remove_orphans(path: Path) -> list[int]:
    """Kill the processes (and their descendants) that a service which died without cleaning up recorded in
    `path`; nothing if that service still runs. Returns the pids killed."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    owner, created = recorded["owner"]
    if _start_time(owner) == created:
        return []  # the service that wrote it still runs: not orphans
    victims = {pid for pid, started in recorded["processes"] if _start_time(pid) == started}
    victims |= {child for pid in victims for child in descendants(pid)}
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    path.unlink(missing_ok=True)
    if victims:
        log.warning("killed %d processes left behind by a service that was killed (its embedded Ray)", len(victims))
    return sorted(victims)


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (/proc/PID/stat field 22), None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if fields[0] != "Z" else None


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found

