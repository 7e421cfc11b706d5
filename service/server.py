"""`trainyard serve`: start (or join) Ray, open the store, and serve the API with uvicorn until a signal.

Shutdown (SIGTERM or SIGINT) takes seconds and exits 0: stop answering requests; on the embedded cluster,
checkpoint every live job and queue it again (with the waiting jobs, for the next start), then shut Ray
down; on a joined cluster, leave the live jobs running for the next start to reattach to.
The signals are ours, not uvicorn's: uvicorn re-raises a caught signal once it has stopped, into the
handler `ray.init` installed, which kills the embedded cluster and exits 1 before the jobs are stopped
(their coordinators then cannot answer, and the process hangs on Ray's reconnect timeout).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ray
import uvicorn
from trainyard.service import state_dir as sd
from trainyard.service.manager import JobManager
from trainyard.service.ray_runtime import connect, record_embedded_processes, remove_orphans
from trainyard.service.store import JobStore
from trainyard.service.tenancy.trackers import TrackerPolicy
from trainyard.service.tenancy.uploads import DEFAULT_MAX_UPLOAD_BYTES
from trainyard.service.tenancy.users import Registry

log = logging.getLogger("trainyard.server")

GRACEFUL_HTTP_S = 5
"""How long in-flight requests may take to finish once a shutdown began."""
KEEP_ALIVE_S = 75
"""How long an idle HTTP connection stays open. Longer than a client's own idle limit (httpx, the CLI's client:
5 s), so the client always drops an idle connection first: at uvicorn's default (5 s, the same) a request on a
connection the server was closing at that moment got "Connection reset by peer", a submit or a stop lost (3 of
1,000 submits and their stops in the soak, `python -m bench.run --only soak`)."""


def http_config(app: Any, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACEFUL_HTTP_S,
                          timeout_keep_alive=KEEP_ALIVE_S)


class PortInUse(SystemExit):
    pass


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUse(f"trainyard serve: cannot listen on {host}:{port} ({e.strerror}); is another "
                            "trainyard serve running? Choose another port with --port") from None


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # `serve` handles the signals for the whole shutdown, and never re-raises them


AppFactory = Callable[..., Any]
"""`api.app.create_app`'s shape: (manager, token, *, ray_address, allow_fault_injection, users, max_upload_bytes)
-> an ASGI app.
Passed in by the CLI, so the service runs the web layer without importing it."""


def serve(make_app: AppFactory, host: str = "127.0.0.1", port: int = 8000, state_dir: str | Path | None = None,
          ray_address: str | None = None, num_cpus: int | None = None, max_queued: int = 1000,
          allow_fault_injection: bool = False, max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
          trackers: TrackerPolicy = TrackerPolicy(), base_models: Mapping[str, str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _check_port_free(host, port)  # before Ray starts: a taken port is an error in milliseconds, not seconds
    # Every file the service and its embedded Ray's processes make (the store, checkpoints, uploads, models, logs)
    # is readable by the service's account only; the processes Ray starts inherit the mask.
    os.umask(0o077)
    directory = sd.resolve(state_dir)
    sd.make_private(directory)
    token = sd.load_or_create_token(directory)
    processes = directory / "ray-processes.json"
    if not ray_address:
        remove_orphans(processes)  # what a killed service's embedded Ray left behind
    info = connect(address=ray_address, num_cpus=num_cpus)
    if info.embedded:
        record_embedded_processes(processes)
    users = Registry(directory)  # `trainyard token create` writes it; read again whenever it changes
    manager = JobManager(JobStore(directory / "jobs.db"), dashboard_url=info.dashboard_url, max_queued=max_queued,
                         detach_jobs=not info.embedded, quotas=users.quota, trackers=trackers)
    manager.tinker.registered.update(base_models or {})  # `--base-model NAME=DIR`: Tinker clients' base models
    app = make_app(manager, token, ray_address=info.address, allow_fault_injection=allow_fault_injection,
                   users=users, max_upload_bytes=max_upload_bytes)
    server = _Server(http_config(app, host, port))

    def on_signal(signum: int, _frame: object) -> None:
        if server.should_exit:  # a second signal: stop waiting for in-flight requests
            server.force_exit = True
        log.info("%s: shutting down", signal.Signals(signum).name)
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    sd.write_server_info(directory, url)
    log.info("trainyard API on %s (state dir %s); Ray dashboard: %s", url, directory, info.dashboard_url)
    try:
        server.run()
    finally:
        manager.shutdown()
        manager.store.close()
        if info.embedded:
            ray.shutdown()
            processes.unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("trainyard stopped")
    return 0
