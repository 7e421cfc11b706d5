"""Section `signals`: SIGTERM to `trainyard serve`'s process group (what systemd sends by default, or
`kill -- -PGID`) against SIGTERM to its process alone, with two running jobs: the seconds until it exited,
and its exit code. Before the embedded Ray's daemons ran in a process group of their own, the group signal
killed them too and the shutdown waited 60 s for the GCS, then exited 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trainyard.cli.demo import wait_ready

from bench.context import REPO, BenchContext
from bench.results import Row, ratio
from bench.service_job import BenchError, free_port

TINY = {"model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16}, "steps": 100_000, "global_batch": 8}


def _exit_after_sigterm(ctx: BenchContext, to: str) -> tuple[float, int]:
    state, port = ctx.run_dir / to, free_port()
    state.mkdir(parents=True, exist_ok=True)
    with (state / "serve.log").open("wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "trainyard.cli.main", "--state-dir", str(state), "serve",
                                   "--port", str(port), "--num-cpus", "4"], cwd=REPO, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # a group of its own
        try:
            client = wait_ready(server, state, port, 180)
            live = [client.submit({**TINY, "name": f"live-{i}"}) for i in range(2)]
            deadline = time.monotonic() + 180
            while any(client.job(j)["step"] < 1 for j in live):
                if time.monotonic() > deadline:
                    raise BenchError("the jobs did not start within 180 s")
                time.sleep(0.5)
            client.close()
            start = time.perf_counter()
            if to == "group":
                os.killpg(server.pid, signal.SIGTERM)
            else:
                server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=180)
            return time.perf_counter() - start, code
        finally:
            if server.poll() is None:
                server.kill()


def run_section(ctx: BenchContext) -> list[Row]:
    (process_s, process_code), (group_s, group_code) = (_exit_after_sigterm(ctx, to) for to in ("process", "group"))
    ctx.log(f"SIGTERM to the process: exit {process_code} after {process_s:.2f} s; "
            f"to the process group: exit {group_code} after {group_s:.2f} s")
    return [Row("exit after SIGTERM to the process group vs to the process, 2 running jobs", group_s, process_s,
                ratio(group_s, process_s), "s", f"exit codes: group {group_code}, process {process_code}")]
