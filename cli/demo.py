"""`make demo`: start the service in a subprocess, submit a JobSpec over REST, follow it, shut down.

Exit code 0 only when the job SUCCEEDED. The service gets its own state directory and port, so the demo
never touches a running `trainyard serve`; its log (and the Ray workers' output) goes to `serve.log` there,
so that the progress bar stays readable.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainyard.cli.client import ApiError, Client
from trainyard.cli.jobs import follow
from trainyard.cli.offline import read_spec_file
from trainyard.service import state_dir as sd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("spec", nargs="?", default="examples/demo.yaml")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    args = p.parse_args()
    state = Path(tempfile.mkdtemp(prefix="trainyard-demo-"))
    log_path = state / "serve.log"
    print(f"starting trainyard serve (state dir {state}, port {args.port}, log {log_path}) ...", flush=True)
    log = log_path.open("wb")
    server = subprocess.Popen([sys.executable, "-m", "trainyard.cli.main", "--state-dir", str(state), "serve",
                               "--port", str(args.port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        client = wait_ready(server, state, args.port, args.startup_timeout_s)
        print(f"Ray dashboard: {client.cluster()['dashboard_url']}", flush=True)
        job_id = client.submit(read_spec_file(args.spec))
        print(f"submitted {args.spec} as job {job_id}", flush=True)
        code = follow(client, job_id)
        rows = client.metrics(job_id)
        if rows:
            print(f"loss: first step {rows[0]['loss']:.4f} -> last step {rows[-1]['loss']:.4f}")
        return code
    except ApiError as e:
        print(f"error: {e} (the service's log: {log_path})", file=sys.stderr)
        return 2
    finally:
        stop(server, signal.SIGINT, 60)
        log.close()
        print("service shut down")


def stop(server: subprocess.Popen, sig: int, timeout_s: float) -> None:
    """Send `sig` to the service and wait for it to exit; kill it if it has not in `timeout_s`."""
    server.send_signal(sig)
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def wait_ready(server: subprocess.Popen, state: Path, port: int, timeout_s: float) -> Client:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ApiError(0, f"trainyard serve exited with code {server.returncode}")
        token = sd.read_token(state)
        if token:
            client = Client(f"http://127.0.0.1:{port}", token)
            try:
                if client.healthz():
                    return client
            except ApiError:
                pass
        time.sleep(0.5)
    raise ApiError(0, f"trainyard serve did not answer within {timeout_s:g} s")


if __name__ == "__main__":
    sys.exit(main())
