"""Section "scale", case `service`: the 501M Llama submitted to a real `trainyard serve` at dp=4, zero=3, 3 steps.

What the issue's Done-when asks: the job submitted as a user would (REST, `cli.client.Client`), its ranks Ray
actors of the service's embedded Ray, trained to SUCCEEDED on this one node. The section measures, per rank, the
Ray worker process itself (the pid the job's `ranks` name, `actors.worker_group.worker.Worker`):

- its baseline, `baseline_rss_bytes` in the job's `ranks` (VmRSS just before its trainer is built: Ray's worker,
  torch and their imports, larger than a spawned rank's);
- its high-water mark (VmHWM), read from /proc/<pid>/status while the job runs (the process exits with the job,
  so the last read is after the last step's result or a little before it: a lower bound);
- the metrics rows' `peak_rss_bytes` (the largest rank's VmHWM after each step, which the worker reads itself:
  the step peak of every step, the last included), which the rows use;
- the coordinator's VmHWM, the Ray actor whose process title is `ray::Coordinator`, read the same way.

Each is set against the training state (the issue's bar: under 40% of it) and the plan the service shows
(`POST /api/plans`, what `trainyard plan` prints: the CPU rank's resident step peak and start-up peak).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainyard.cli.jobs import TERMINAL

from bench.context import BenchContext
from bench.results import Row, at_most, ratio
from bench.service_job import BenchError, TrainyardService

GIB = 2**30
TIMEOUT_S = 1500.0
"""Start-up (meta construction, four ranks) and three steps of the 501M model on two shared cores."""


def status_bytes(pid: int, field: str) -> int | None:
    """VmRSS or VmHWM of process `pid` in bytes; None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _descends(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` is `pid`'s parent, grandparent, ... (read from /proc)."""
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid, after the (command) that may hold spaces
        if pid == ancestor:
            return True
    return False


def coordinator_pids(service_pid: int) -> list[int]:
    """The processes under the service whose title is the coordinator actor's (`ray::Coordinator...`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            continue
        if title.startswith(b"ray::Coordinator") and _descends(int(entry.name), service_pid):
            found.append(int(entry.name))
    return found


def run_case(ctx: BenchContext, spec: dict[str, Any], state: int, bar: float) -> list[Row]:
    """Submit `spec` to a fresh service, follow it to its end while reading its processes' memory, and return the
    rows (`state`: the training state's bytes; `bar`: the most a rank's peak may be of it)."""
    dp = spec["parallel"]["dp"]
    with TrainyardService(ctx.run_dir / "service", startup_timeout_s=300.0) as service:
        assert service.client is not None and service._server is not None
        client, service_pid = service.client, service._server.pid
        planned = client.plan(spec)["memory"]["per_rank"]
        start = time.perf_counter()
        job_id = client.submit(spec)
        ctx.log(f"submitted {job_id}; following it (memory read from /proc every second)")
        hwm: dict[int, int] = {}  # rank -> its Ray worker's VmHWM, last read
        coordinator: dict[int, int] = {}  # pid -> VmHWM
        while (job := client.job(job_id))["status"] not in TERMINAL:
            if time.perf_counter() - start > TIMEOUT_S:
                client.stop(job_id)
                raise BenchError(f"job {job_id} did not finish within {TIMEOUT_S:g} s")
            for info in job["ranks"]:
                got = status_bytes(info["pid"], "VmHWM")
                if got is not None:
                    hwm[info["rank"]] = got
            for pid in coordinator_pids(service_pid) if not coordinator else list(coordinator):
                got = status_bytes(pid, "VmHWM")
                if got is not None:
                    coordinator[pid] = got
            time.sleep(1.0)
        wall = time.perf_counter() - start
        if job["status"] != "SUCCEEDED":
            raise BenchError(f"job {job_id} ended {job['status']} after {wall:.0f} s: {job.get('error')}; see "
                             f"{service.log_path} and `trainyard logs`")
        metrics = client.metrics(job_id)
    ranks = sorted(job["ranks"], key=lambda r: r["rank"])
    row_peaks = [m["peak_rss_bytes"] for m in metrics if m.get("peak_rss_bytes")]
    if len(row_peaks) != len(metrics) or not ranks or len(hwm) != dp:
        raise BenchError(f"job {job_id}: peaks in {len(row_peaks)} of {len(metrics)} metrics rows, VmHWM read for "
                         f"{len(hwm)} of {dp} ranks")
    ctx.log(f"job {job_id} SUCCEEDED in {wall:.0f} s; losses {[m['loss'] for m in metrics]}")
    peak = max(row_peaks)  # the last step's included
    plan_step = max(max(p["total"] + p["host_total"], p["startup"]) for p in planned)  # a CPU rank's resident peak
    plan_start = max(p["startup"] for p in planned)
    baseline = max(r["baseline_rss_bytes"] for r in ranks)
    for r in ranks:
        ctx.log(f"rank {r['rank']} (pid {r['pid']}): baseline {r['baseline_rss_bytes'] / GIB:.2f} GiB; VmHWM last read "
                f"{hwm[r['rank']] / GIB:.2f} GiB (+{(hwm[r['rank']] - r['baseline_rss_bytes']) / GIB:.2f} above it)")
    ctx.log(f"metrics rows' peak_rss_bytes per step: {[round(p / GIB, 3) for p in row_peaks]} GiB; plan: step "
            f"{plan_step / GIB:.2f} GiB above the baseline, start-up {plan_start / GIB:.2f}; coordinator VmHWM "
            f"{[round(v / GIB, 3) for v in coordinator.values()]} GiB")
    if abs(max(hwm.values()) - peak) > 0.02 * peak:
        ctx.log(f"note: the largest VmHWM read from /proc ({max(hwm.values()) / GIB:.3f} GiB) and the rows' peak "
                f"({peak / GIB:.3f} GiB) differ by more than 2% (the last read came before the last step's peak?)")
    note = (f"501M llama submitted to trainyard serve at dp={dp} zero=3, {spec['steps']} steps, {wall:.0f} s; ranks"
            " are Ray actors of the embedded Ray on this machine; peak = the metrics rows' peak_rss_bytes (each rank "
            "process's VmHWM from /proc)")
    above = peak - baseline  # the largest rank's peak less the largest baseline: the ranks' baselines are alike
    rows = [
        Row(f"scale: rank peak RSS / training state, through the service, dp={dp} zero=3", peak / state, None, None,
            "x", f"{note}; state = {state / GIB:.2f} GiB", target=at_most(bar)),
        Row("scale: rank peak RSS above the Ray worker's baseline vs the plan (GiB), through the service",
            above / GIB, plan_step / GIB, ratio(above, plan_step), "GiB",
            f"{note}; baseline = VmRSS before the trainer ({baseline / GIB:.2f} GiB, largest rank); plan: POST "
            "/api/plans, the step peak of a CPU rank"),
        Row("scale: Ray worker baseline RSS before the trainer, through the service (GiB)", baseline / GIB, None,
            None, "GiB", f"{note}; largest of the {dp} ranks"),
    ]
    if coordinator:
        rows.append(Row("scale: coordinator peak RSS, through the service (GiB)", max(coordinator.values()) / GIB,
                        None, None, "GiB", f"{note}; the ray::Coordinator actor's VmHWM, last read before it exited"))
    return rows
