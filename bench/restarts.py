"""The service restarts of section `faults`: `trainyard serve` stopped under a running job, then started again.

Each round, one job runs on an embedded-Ray `trainyard serve` with its own state directory; the service is
stopped twice while the job trains, and each time a new `trainyard serve` process is launched on the same
state directory:
- SIGTERM: the service has the job write a checkpoint, queues it again and exits; measured: the seconds from
  the signal until the process exited (its exit code must be 0);
- SIGKILL: the service writes nothing; the job trains on in the dead service's embedded Ray until the next
  start kills that and queues the job again.
Either way the job goes on from its latest checkpoint (step C, read from its checkpoint folder once the new
service answers); measured: the seconds from launching the new process until the job's step C + 1 is
finished, i.e. until `GET /api/jobs/{id}` shows the job admitted again with `step` > C (polled every 0.1 s;
the service itself polls its jobs every 0.5 s, so this is up to about 0.6 s late). The job must end
SUCCEEDED with exactly the losses of an uninterrupted run, and with one `interrupted` event per restart.
"""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.parallel.io import checkpoint

from bench.context import BenchContext
from bench.service_job import BenchError, TrainyardService, wait_job

STEPS_BEFORE_STOP = 20
"""Steps the job trains after (re)starting before the service is stopped under it."""


@dataclass(frozen=True)
class Restart:
    signal: str
    exit_s: float
    """Signal to process exit (SIGTERM only; a SIGKILL is immediate)."""
    ready_s: float
    """Launch of the new process to its API answering."""
    next_step_s: float
    """Launch of the new process to the job's next finished step."""
    resumed_from: int


def run_round(ctx: BenchContext, state_dir: Path, spec: dict[str, Any], reference: list[float]) -> list[Restart]:
    """One job through a SIGTERM and a SIGKILL restart; the two measurements, in that order."""
    restarts = []
    with ExitStack() as stack:
        svc = stack.enter_context(TrainyardService(state_dir, log_name="serve-0.log"))
        job_id = svc.client.submit(spec)
        resumed_from = 0
        for i, sig in enumerate((signal.SIGTERM, signal.SIGKILL), start=1):
            wait_job(svc.client, job_id, lambda j, s=resumed_from: j["status"] == "RUNNING"
                     and j["step"] >= s + STEPS_BEFORE_STOP, f"step {resumed_from + STEPS_BEFORE_STOP}")
            exit_s, code = svc.terminate(sig)
            if sig == signal.SIGTERM and code != 0:
                raise BenchError(f"trainyard serve exited with {code} on SIGTERM; see {svc.log_path}")
            stack.close()  # the stopped service's client and log
            launched = time.perf_counter()
            svc = stack.enter_context(TrainyardService(state_dir, log_name=f"serve-{i}.log"))
            ready_s = time.perf_counter() - launched
            found = checkpoint.latest_valid(state_dir / "checkpoints" / job_id)
            resumed_from = found.step if found else 0
            wait_job(svc.client, job_id, lambda j, s=resumed_from: j["status"] != "PENDING" and j["step"] > s,
                     f"step {resumed_from + 1} after the restart", poll_s=0.1)
            restarts.append(Restart(sig.name, exit_s if sig == signal.SIGTERM else 0.0, ready_s,
                                    time.perf_counter() - launched, resumed_from))
            ctx.log(f"{sig.name}: exited after {exit_s:.2f} s (code {code}); new service ready after {ready_s:.2f} s, "
                    f"the job's step {resumed_from + 1} finished {restarts[-1].next_step_s:.2f} s after launch")
        job = wait_job(svc.client, job_id, lambda j: j["status"] in ("SUCCEEDED", "FAILED", "STOPPED"), "its end",
                       timeout_s=600, poll_s=0.5)
        if job["status"] != "SUCCEEDED":
            raise BenchError(f"job {job_id} ended {job['status']} after the restarts: {job['error']}")
        interrupted = sum(e["kind"] == "interrupted" for e in svc.client.events(job_id))
        losses = [r["loss"] for r in svc.client.metrics(job_id)]
    if interrupted != 2:
        raise BenchError(f"job {job_id} has {interrupted} interrupted events after 2 restarts")
    if losses != reference:
        raise BenchError(f"job {job_id}: the losses after the restarts differ from the uninterrupted run's")
    return restarts
