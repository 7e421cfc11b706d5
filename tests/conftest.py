"""Shared fixtures: one real Ray for the session, and real uvicorn servers of the API over HTTP."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import wait_for

# The suite starts some 150 Python processes (each job's coordinator and ranks are Ray workers; `trainyard serve` runs
# as a process of its own), each importing the checkout's modules. Where PYTHONDONTWRITEBYTECODE is set, each would
# compile them anew (0.3 s of a rank's CPU); here the first compiles them into __pycache__ (git-ignored), the rest
# read that. The processes inherit this environment: Ray's workers through its daemons, started by `ray.init` below.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Tests only: the product keeps Ray's token auth on. Set here, before any test module is collected: Ray reads it once,
# as it is imported, and a test module may import Ray at its top (or `trainyard.cli.main`, which sets the product's
# `token` unless it is set already); a driver that read `token` talks to the session's daemons, started without
# auth, in a way they drop (a client's actor "cancelled before it started": seen when a unit test that imports the
# CLI was collected before the first module importing Ray).
os.environ["RAY_AUTH_MODE"] = "disabled"


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray
    from trainyard.service.ray_runtime import agent_port_clear_of_other_clusters

    # Workers at nice 0, as the product's embedded Ray starts them (service.ray_runtime.connect): at Ray's default
    # of 15 the jobs' ranks lose the cores to Ray's daemons, to this process, and to anything else on the machine.
    os.environ["RAY_worker_niceness"] = "0"
    # The dashboard serves Ray's log API, which the logs endpoint reads, as in the product's embedded Ray. Metrics
    # reach Ray's Prometheus export every 2 s instead of 10 (the export test waits for them). A Ray of its own, as
    # the product's embedded one, also where another Ray runs on the machine: `address=None` would join whatever
    # RAY_ADDRESS or /tmp/ray/ray_current_cluster names (a `ray start`, or one that died and left the file) and
    # fail on `num_cpus`; and its dashboard agent needs a port of its own, or the log API finds no agent.
    with agent_port_clear_of_other_clusters():
        ray.init(address="local", num_cpus=8, object_store_memory=100 * 1024 * 1024, include_dashboard=True,
                 namespace="trainyard", log_to_driver=False, _system_config={"metrics_report_interval_ms": 2000})
    yield
    ray.shutdown()


@dataclass
class Service:
    url: str
    token: str
    state_dir: Path
    manager: object
    server: object
    thread: threading.Thread

    def client(self):
        from trainyard.cli.client import Client

        return Client(self.url, self.token)

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.manager.shutdown()
        self.manager.store.close()


def start_service(state_dir: Path, allow_fault_injection: bool = True, **manager_options) -> Service:
    """The real service stack (store, manager, FastAPI app, uvicorn) on a free loopback port.

    `manager_options` go to JobManager (e.g. `admit=False` keeps every job queued, `max_queued`). Fault
    drills are on, as under `trainyard serve --allow-fault-injection`, unless `allow_fault_injection=False`."""
    import uvicorn
    from trainyard.api.app import create_app
    from trainyard.service import state_dir as sd
    from trainyard.service.manager import JobManager
    from trainyard.service.store import JobStore
    from trainyard.service.tenancy.users import Registry

    token = sd.load_or_create_token(sd.resolve(state_dir))
    users = Registry(state_dir)  # `trainyard token create --state-dir` adds users to it, as to `trainyard serve`'s
    # Polls every 0.3 s (the product's default is 0.5): at 0.1 s, a module of four jobs at once took 3-10 s longer
    # on two cores, its coordinators answering polls instead of training.
    manager = JobManager(JobStore(state_dir / "jobs.db"), poll_interval_s=0.3, quotas=users.quota, **manager_options)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(manager, token, allow_fault_injection=allow_fault_injection, users=users)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn to start")
    return Service(f"http://127.0.0.1:{port}", token, state_dir, manager, server, thread)


@pytest.fixture(scope="session")
def service(ray_session, tmp_path_factory) -> Iterator[Service]:
    svc = start_service(tmp_path_factory.mktemp("state"))
    yield svc
    svc.shutdown()


@pytest.fixture()
def client(service):
    c = service.client()
    yield c
    c.close()




@pytest.fixture(scope="session")
def three_d_job(service) -> tuple[dict, list[dict]]:
    """One finished (dp=2, pp=2, tp=2, ep=2) job of 8 ranks, 1F1B over two micro-batches, and its metrics rows: the
    flagship of the pipeline, tensor-parallel and MoE files (their layouts' numerics are checked on gloo), and of
    the llama family through the service (grouped-query attention: 4 heads, 2 key/value heads, one per tp rank;
    4 experts, 2 per ep rank)."""
    from helpers import THREE_D_SPEC, run_all

    client = service.client()
    out = run_all(client, {"3d": THREE_D_SPEC})["3d"]
    client.close()
    return out
