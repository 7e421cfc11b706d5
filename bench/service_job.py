"""Running one JobSpec through the real trainyard service, the way a user would, and fetching its metrics.

`TrainyardService` starts `python -m trainyard.cli.main --state-dir <dir> serve --port <free port>` in a
subprocess as service/demo.py does (the server's output goes to `<dir>/serve.log`, or another name so that
a restart on the same directory keeps both), waits for /healthz with the demo's own wait, and shuts the
server down with SIGINT on exit. `run_job` submits a spec over REST with `cli.client.Client`, waits
for SUCCEEDED and returns the job's per-step metrics rows (`GET /api/jobs/{id}/metrics`); `wait_job` polls
a job until a condition on it holds.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from trainyard.cli.client import ApiError, Client
from trainyard.cli.demo import wait_ready  # the demo's own readiness wait
from trainyard.cli.jobs import TERMINAL


class BenchError(RuntimeError):
    """A benchmark run did not produce its measurements."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_job(client: Client, job_id: str, until: Callable[[dict[str, Any]], bool], what: str,
             timeout_s: float = 300.0, poll_s: float = 0.2) -> dict[str, Any]:
    """Poll `GET /api/jobs/{id}` until `until(job)` holds and return that job; BenchError after `timeout_s`, or
    when the job ends first (unless `until` accepts the ended job)."""
    deadline = time.monotonic() + timeout_s
    while not until(job := client.job(job_id)):
        if job["status"] in TERMINAL:
            raise BenchError(f"job {job_id} ended {job['status']} before {what}: {job.get('error')}")
        if time.monotonic() > deadline:
            raise BenchError(f"job {job_id}: no {what} within {timeout_s:g} s (status {job['status']}, "
                             f"step {job['step']})")
        time.sleep(poll_s)
    return job


class TrainyardService:
    """A `trainyard serve` subprocess with its own state directory and port, as a context manager."""

    def __init__(self, state_dir: Path, startup_timeout_s: float = 180.0, serve_args: tuple[str, ...] = (),
                 log_name: str = "serve.log"):
        """`log_name`: the server's output file in `state_dir` (a restart on the same directory keeps both)."""
        self.state_dir, self.startup_timeout_s, self.serve_args = state_dir, startup_timeout_s, serve_args
        self.port = free_port()
        self.log_path = state_dir / log_name
        self._server: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self.client: Client | None = None

    def __enter__(self) -> TrainyardService:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        cmd = [sys.executable, "-m", "trainyard.cli.main", "--state-dir", str(self.state_dir),
               "serve", "--port", str(self.port), *self.serve_args]
        self._server = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self.client = wait_ready(self._server, self.state_dir, self.port, self.startup_timeout_s)
        except ApiError as e:
            self.__exit__(None, None, None)
            raise BenchError(f"{e}; see {self.log_path}") from None
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.client is not None:
            self.client.close()
        if self._server is not None and self._server.poll() is None:
            self._server.send_signal(signal.SIGINT)
            try:
                self._server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        if self._log is not None:
            self._log.close()

    def terminate(self, sig: int = signal.SIGTERM, timeout_s: float = 120.0) -> tuple[float, int]:
        """Send `sig` to the server and wait for it to exit: (seconds until it exited, its exit code)."""
        assert self._server is not None
        start = time.perf_counter()
        self._server.send_signal(sig)
        try:
            code = self._server.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._server.kill()
            raise BenchError(f"trainyard serve did not exit within {timeout_s:g} s of signal {sig}") from None
        return time.perf_counter() - start, code

    def run_job(self, spec: dict[str, Any], timeout_s: float = 600.0, poll_s: float = 1.0) -> list[dict[str, Any]]:
        """Submit `spec`, wait until it ends, and return its metrics rows; raises BenchError unless SUCCEEDED."""
        assert self.client is not None, "use TrainyardService as a context manager"
        job_id = self.client.submit(spec)
        deadline = time.monotonic() + timeout_s
        while (job := self.client.job(job_id))["status"] not in TERMINAL:
            if time.monotonic() > deadline:
                self.client.stop(job_id)
                raise BenchError(f"job {job_id} did not finish within {timeout_s:g} s")
            time.sleep(poll_s)
        if job["status"] != "SUCCEEDED":
            raise BenchError(f"job {job_id} ended {job['status']}: {job.get('error')}")
        return self.client.metrics(job_id)
