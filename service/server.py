"""`trainyard serve`: start (or join) Ray, open the store, and serve the API with uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path

import ray
import uvicorn

from api.app import create_app
from service import state_dir as sd
from service.manager import JobManager
from service.ray_runtime import connect
from service.store import JobStore

log = logging.getLogger("trainyard.server")


def serve(host: str = "127.0.0.1", port: int = 8000, state_dir: str | Path | None = None,
          ray_address: str | None = None, num_cpus: int | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    directory = sd.resolve(state_dir)
    token = sd.load_or_create_token(directory)
    info = connect(address=ray_address, num_cpus=num_cpus)
    manager = JobManager(JobStore(directory / "jobs.db"), dashboard_url=info.dashboard_url)
    app = create_app(manager, token, ray_address=info.address)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    sd.write_server_info(directory, url)
    log.info("trainyard API on %s (state dir %s); Ray dashboard: %s", url, directory, info.dashboard_url)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        manager.shutdown()
        manager.store.close()
        if info.embedded:
            ray.shutdown()
