"""Section `faults`: how long a job takes to recover from each fault drill, to notice a hang, and to go on
after its service restarts.

A (dp=2, pp=2, m=2) job checkpointing every 3 steps runs through a real `trainyard serve
--allow-fault-injection` subprocess; a drill kills or hangs one rank, or kills the job's coordinator, at a
step that neither saves nor evaluates; these jobs set `fault.from_replica: false`, so they measure the
checkpoint path. The kill is then run again on a job that recovers from a live replica (the default): the
killed rank's replica gives it the state of the failed step, no checkpoint read, no step lost. From the job's
events: `recovery_s`, the seconds from the failure being noticed to the next finished step (the ranks torn
down and brought back, the checkpoint loaded, the lost step run again), and `waited_s`, the seconds from the
failed step's start until the failure was noticed: for a kill, Ray's report plus the grace the coordinator
gives the other ranks; for a hang, the hang detector's deadline (fault.hang_factor x the median step, at least
fault.hang_floor_s). A coordinator's death counts from its last recorded step instead: `waited_s` until Ray
restarted it, `recovery_s` until the next finished step (its whole restart included). Each drill runs
`ctx.rounds` times (at most 3); the rows are medians, and every run must end SUCCEEDED with the uninterrupted
run's losses.

Then the service itself is restarted under a longer job, by SIGTERM and by SIGKILL (`bench.restarts`): the
seconds SIGTERM takes to end the process, and from launching the new process to the job's next finished step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from bench import restarts
from bench.context import BenchContext
from bench.results import Row, at_most, median
from bench.service_job import BenchError, TrainyardService

SPEC = {
    "name": "drill", "seed": 3,
    "model": {"n_layer": 4, "n_head": 2, "d_model": 64, "seq_len": 32},
    "steps": 12, "global_batch": 8, "checkpoint": {"every": 3},
    "parallel": {"dp": 2, "pp": 2, "microbatches": 2},
    "fault": {"max_failures": 1, "from_replica": False},  # the default floor: fault.hang_floor_s = 5 s
}
"""The checkpoint path: recovery goes back to the latest checkpoint."""
REPLICA_SPEC = {**SPEC, "name": "drill-replica", "fault": {"max_failures": 1}}
"""Recovery from a live replica (fault.from_replica, the default): the killed rank's replica gives it the state of
the failed step; no checkpoint read, no step lost."""
RESTART_SPEC = {**SPEC, "name": "restart", "steps": 300, "checkpoint": {"every": 10}}
"""Long enough to be running through both restarts (each 20 steps or more after the job went on)."""
DRILLS = (("kill_worker", 1), ("hang_worker", 2), ("kill_coordinator", 0))  # the coordinator drill ignores rank
RECOVERY_TARGET_S = 10.0  # failure to the next finished step
AT_STEP = 7  # 7 + 1 is no multiple of 3: the step saves nothing
WHAT = {  # kind -> (what waited_s measures, what recovery_s measures)
    "kill_coordinator": ("last recorded step to coordinator restarted", "last recorded step to next finished step "
                                                                         "(recovery)"),
}
DEFAULT_WHAT = ("failed step's start to failure noticed", "failure to next finished step (recovery)")


def run_section(ctx: BenchContext) -> list[Row]:
    rounds = min(3, ctx.rounds or 3)
    with TrainyardService(ctx.run_dir / "serve", serve_args=("--allow-fault-injection",)) as svc:
        reference = [r["loss"] for r in svc.run_job(SPEC)]
        rows = []
        for kind, rank in DRILLS:
            rows += _drill_rows(ctx, svc, kind, rank, rounds, reference)
        rows += _drill_rows(ctx, svc, "kill_worker", 1, rounds, reference, REPLICA_SPEC, "from a live replica")
        restart_reference = [r["loss"] for r in svc.run_job(RESTART_SPEC)]
    measured = [m for i in range(rounds)
                for m in restarts.run_round(ctx, ctx.run_dir / f"restart-{i}", RESTART_SPEC, restart_reference)]
    return rows + _restart_rows(measured, rounds)


def _drill_rows(ctx: BenchContext, svc: TrainyardService, kind: str, rank: int, rounds: int,
                reference: list[float], spec: dict = SPEC, source: str = "") -> list[Row]:
    recovery, waited, sources = [], [], []
    label = f"{kind} ({source})" if source else kind
    for i in range(rounds):
        events, losses = _drill(svc, kind, rank, spec)
        if losses != reference:
            raise BenchError(f"{kind} round {i}: the losses differ from the uninterrupted run's")
        failure = next(e for e in events if e["kind"] == "failure")
        sources.append(f"{failure['recovered_from']}, {failure['steps_lost']} lost")
        if kind == "kill_coordinator" and failure["ranks"]:
            raise BenchError(f"{kind} round {i}: the failure names ranks {failure['ranks']}, not the coordinator")
        recovery.append(next(e for e in events if e["kind"] == "recovered")["recovery_s"])
        waited.append(failure["waited_s"])
        ctx.log(f"{label} round {i}: noticed after {failure['waited_s']:.2f} s, recovered in "
                f"{recovery[-1]:.2f} s ({failure['steps_lost']} step lost)")
    waited_what, recovery_what = WHAT.get(kind, DEFAULT_WHAT)
    return [
        Row(f"{label}: {recovery_what}", median(recovery), None, None, "s",
            f"median of {rounds}: {_values(recovery)}; recovered from: {'; '.join(sources)}",
            target=at_most(RECOVERY_TARGET_S)),
        Row(f"{label}: {waited_what}", median(waited), None, None, "s", f"median of {rounds}: {_values(waited)}"),
    ]


def _restart_rows(measured: list[restarts.Restart], rounds: int) -> list[Row]:
    term = [m for m in measured if m.signal == "SIGTERM"]
    rows = [Row("service SIGTERM with a running job: signal to process exit", median(m.exit_s for m in term),
                None, None, "s", f"median of {rounds}: {_values(m.exit_s for m in term)}; exit code 0, the job "
                                 "checkpointed and queued again")]
    for sig in ("SIGTERM", "SIGKILL"):
        of = [m for m in measured if m.signal == sig]
        rows.append(Row(f"service restart after {sig}: launch to the job's next finished step",
                        median(m.next_step_s for m in of), None, None, "s",
                        f"median of {rounds}: {_values(m.next_step_s for m in of)}; of which launch to API ready "
                        f"{_values(m.ready_s for m in of)}; went on from the checkpoints of steps "
                        f"{', '.join(str(m.resumed_from) for m in of)}"))
    return rows


def _values(values: Iterable[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _drill(svc: TrainyardService, kind: str, rank: int, spec: dict) -> tuple[list[dict], list[float]]:
    client = svc.client
    job_id = client.submit(spec)
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
