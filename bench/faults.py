"""Section `faults`: how long a job takes to recover from each fault drill, and to notice a hang.

A (dp=2, pp=2, m=2) job checkpointing every 3 steps runs through a real `trainyard serve
--allow-fault-injection` subprocess; a drill kills or hangs one rank at a step that neither saves nor
evaluates. From the job's events: `recovery_s`, the seconds from the failure being noticed to the next
finished step (the ranks torn down and brought back, the checkpoint loaded, the lost step run again), and
`waited_s`, the seconds from the failed step's start until the failure was noticed: for a kill, Ray's
report plus the grace the coordinator gives the other ranks; for a hang, the hang detector's deadline
(fault.hang_factor x the median step, at least fault.hang_floor_s). Each drill runs `ctx.rounds` times
(at most 3); the rows are medians, and every run must end SUCCEEDED with the uninterrupted run's losses.
"""

from __future__ import annotations

import time

from bench.context import BenchContext
from bench.results import Row, median
from bench.service_job import BenchError, TrainyardService

SPEC = {
    "name": "drill", "seed": 3,
    "model": {"n_layer": 4, "n_head": 2, "d_model": 64, "seq_len": 32},
    "steps": 12, "global_batch": 8, "checkpoint": {"every": 3},
    "parallel": {"dp": 2, "pp": 2, "microbatches": 2},
    "fault": {"max_failures": 1},  # the default floor: fault.hang_floor_s = 5 s
}
DRILLS = (("kill_worker", 1), ("hang_worker", 2))
AT_STEP = 7  # 7 + 1 is no multiple of 3: the step saves nothing


def run_section(ctx: BenchContext) -> list[Row]:
    rounds = min(3, ctx.rounds or 3)
    with TrainyardService(ctx.run_dir / "serve", serve_args=("--allow-fault-injection",)) as svc:
        reference = [r["loss"] for r in svc.run_job(SPEC)]
        rows = []
        for kind, rank in DRILLS:
            recovery, waited = [], []
            for i in range(rounds):
                events, losses = _drill(svc, kind, rank)
                if losses != reference:
                    raise BenchError(f"{kind} round {i}: the losses differ from the uninterrupted run's")
                failure = next(e for e in events if e["kind"] == "failure")
                recovery.append(next(e for e in events if e["kind"] == "recovered")["recovery_s"])
                waited.append(failure["waited_s"])
                ctx.log(f"{kind} round {i}: noticed after {failure['waited_s']:.2f} s, recovered in "
                        f"{recovery[-1]:.2f} s ({failure['steps_lost']} step lost)")
            rows += [
                Row(f"{kind}: failure to next finished step (recovery)", median(recovery), None, None, "s",
                    f"median of {rounds}: {', '.join(f'{v:.2f}' for v in recovery)}; target <= 10 s"),
                Row(f"{kind}: failed step's start to failure noticed", median(waited), None, None, "s",
                    f"median of {rounds}: {', '.join(f'{v:.2f}' for v in waited)}"),
            ]
    return rows


def _drill(svc: TrainyardService, kind: str, rank: int) -> tuple[list[dict], list[float]]:
    client = svc.client
    job_id = client.submit(SPEC)
    deadline = time.monotonic() + 300
    while client.job(job_id)["status"] == "PENDING":
        if time.monotonic() > deadline:
            raise BenchError(f"job {job_id} did not start")
        time.sleep(0.2)
    client._call("POST", f"/api/jobs/{job_id}/faults", json={"kind": kind, "rank": rank, "at_step": AT_STEP})
    while (job := client.job(job_id))["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
        if time.monotonic() > deadline:
            raise BenchError(f"job {job_id} did not finish")
        time.sleep(0.5)
    if job["status"] != "SUCCEEDED":
        raise BenchError(f"job {job_id} ended {job['status']}: {job['error']}")
    return client.events(job_id), [r["loss"] for r in client.metrics(job_id)]
