"""Section `soak`: many jobs through many faults for a while, on a two-node cluster, through one service.

`python -m bench.run --only soak` (about 11 minutes on a 2-core machine; `--quick`: about 5). A
`ray.cluster_utils.Cluster` of two nodes (6 logical CPUs each) and a `trainyard serve --ray-address ...
--allow-fault-injection` subprocess (bench.service_job.TrainyardService) joined to it. Four soak jobs run at once,
one per layout (dp=2; pp=2 x dp=2; tp=2; MoE at dp=2 x ep=2: tiny models, checkpoints every 10 steps), each owned
by a user of its own (`service.tenancy.users`) whose quota is what that job holds; when one ends, the next job of its
layout is submitted, until the fault phase is over. Every `interval` seconds a fault from a seeded schedule
(bench.soak_faults: kill a worker, hang a rank, kill a coordinator, SIGKILL and restart the service, remove the
second node and add a new one) hits them; halfway, the users submit a burst of queued tiny jobs (bench.soak_checks,
1,000; `--quick` 200), which their quotas hold, then stop and delete them.

Checked and reported: per fault kind, the count, the job hits recovered and the time to recover (median, max);
every soak job SUCCEEDED with losses bit-identical to its layout's twin (the same spec run once before the soak,
uninterrupted); every burst submit answered and no job shown to another user; the store against Ray after each
service restart, the burst and at the end; no trainyard Ray actor, placement group or process left behind.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from contextlib import ExitStack
from typing import Any

import ray
from trainyard.cli.client import Client
from trainyard.service.tenancy import users

from bench import soak_checks as checks
from bench import soak_faults as faults
from bench.context import REPO, BenchContext
from bench.results import Row, at_least, at_most, median
from bench.service_job import BenchError, TrainyardService, wait_job

SEED = 51
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp": {"dp": 2, "microbatches": 2},
    "pp-dp": {"pp": 2, "dp": 2, "microbatches": 2},
    "tp": {"tp": 2},
    "moe": {"dp": 2, "ep": 2, "microbatches": 2},
}
NODE = {"num_cpus": 6, "object_store_memory": 100 * 2**20}
FULL = {"steps": 80, "fault_phase_s": 440.0, "interval_s": 20.0, "burst": 1000}
QUICK = {"steps": 40, "fault_phase_s": 100.0, "interval_s": 12.0, "burst": 200}
BURST_SPEC = {"model": {"n_layer": 1, "n_head": 2, "d_model": 32, "vocab_size": 256, "seq_len": 16},
              "data": {"kind": "text", "path": str(REPO / "examples" / "corpus.txt")},
              "steps": 2, "global_batch": 8, "priority": -1}
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def spec(layout: str, steps: int) -> dict[str, Any]:
    model: dict[str, Any] = {"n_layer": 4, "n_head": 2, "d_model": 32, "vocab_size": 256, "seq_len": 16}
    if layout == "moe":
        model["moe"] = {"experts": 4, "top_k": 2, "every": 2}
    return {"name": f"soak-{layout}", "seed": SEED, "model": model,
            "data": {"kind": "text", "path": str(REPO / "examples" / "corpus.txt")},
            "optimizer": {"lr": 3e-3, "warmup_steps": 2}, "steps": steps, "global_batch": 8,
            "checkpoint": {"every": faults.EVERY}, "parallel": LAYOUTS[layout], "priority": 1,
            # a slow step on two loaded cores is no hang; a node gets 120 s to come back
            "fault": {"max_failures": 50, "hang_floor_s": 20, "node_grace_s": 120}}


class Soak:
    def __init__(self, ctx: BenchContext, cluster: Any):
        self.ctx, self.cluster = ctx, cluster
        self.size = QUICK if ctx.quick else FULL
        self.state = ctx.run_dir / "serve"
        self.serve_args = ("--ray-address", cluster.address, "--allow-fault-injection", "--max-queued", "3000")
        self.starts = 0
        self.svc = self._start()
        self.tokens: dict[str, str] = {}
        self.current: dict[str, str] = {}  # layout -> its running soak job
        self.done: list[tuple[str, str]] = []  # (layout, job id) of every soak job, in submission order
        self.faults: list[faults.Fault] = []
        self.disagreements: list[str] = []

    def _start(self) -> TrainyardService:
        svc = TrainyardService(self.state, serve_args=self.serve_args, log_name=f"serve-{self.starts}.log")
        self.starts += 1
        return svc.__enter__()

    @property
    def admin(self) -> Client:
        assert self.svc.client is not None
        return self.svc.client

    @property
    def admin_token(self) -> str:
        return self.admin._http.headers["Authorization"].split()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.svc.port}"

    def twins(self) -> dict[str, list[float]]:
        """Each layout's spec run once, uninterrupted (all four at once), and the users, each with the quota their
        layout's job holds."""
        for layout in LAYOUTS:
            bundles = self.admin.plan(spec(layout, self.size["steps"]))["resources"]["bundles"]
            limits = users.Limits(data_roots=(str(REPO / "examples"),), max_priority=1)  # what `spec` reads and asks
            self.tokens[layout] = users.create(self.state, f"soak-{layout}",
                                               max_cpus=sum(b.get("CPU", 0.0) for b in bundles), limits=limits)
        ids = {layout: self.admin.submit(spec(layout, self.size["steps"])) for layout in LAYOUTS}
        out = {}
        for layout, job_id in ids.items():
            job = wait_job(self.admin, job_id, lambda j: j["status"] in TERMINAL, "its end", timeout_s=900, poll_s=1)
            if job["status"] != "SUCCEEDED":
                raise BenchError(f"twin {layout} ended {job['status']}: {job['error']}")
            out[layout] = [r["loss"] for r in self.admin.metrics(job_id)]
        self.ctx.log(f"twins done: {', '.join(f'{k} {len(v)} steps' for k, v in out.items())}")
        return out

    def keep_running(self, submit: bool) -> dict[str, dict]:
        """Submit the next job of every layout whose job ended (when `submit`); the running soak jobs."""
        running = {}
        for layout in LAYOUTS:
            job_id = self.current.get(layout)
            job = self.admin.job(job_id) if job_id else None
            if job is not None and job["status"] not in TERMINAL:
                if job["status"] == "RUNNING" and job["ranks"]:
                    running[job_id] = job
                continue
            if job is not None:
                del self.current[layout]
                self.ctx.log(f"{layout} job {job_id} ended {job['status']} at step {job['step']}")
            if submit:
                job_id = Client(self.url, self.tokens[layout]).submit(spec(layout, self.size["steps"]))
                self.current[layout] = job_id
                self.done.append((layout, job_id))
        return running

    def service_sigkill(self, running: dict[str, dict]) -> faults.Fault:
        steps = {j: job["step"] for j, job in running.items()}
        at = time.time()
        self.svc.terminate(signal.SIGKILL)
        self.svc.__exit__(None, None, None)
        launched = time.perf_counter()
        self.svc = self._start()
        fault = faults.Fault("service_sigkill", at, list(steps), f"new service ready after "
                                                                   f"{time.perf_counter() - launched:.1f} s")
        deadline = time.monotonic() + 300
        while set(steps) - set(fault.recovery_s) and time.monotonic() < deadline:
            for job_id in sorted(set(steps) - set(fault.recovery_s)):
                job = self.admin.job(job_id)
                if job["step"] > steps[job_id] or job["status"] == "SUCCEEDED":
                    fault.recovery_s[job_id] = time.time() - at
            time.sleep(0.2)
        self.check_store("after the service restart")
        return fault

    def check_store(self, when: str) -> None:
        found = checks.settled(lambda: checks.store_vs_ray(self.admin.jobs()))
        self.disagreements += [f"{when}: {p}" for p in found]
        self.ctx.log(f"store vs Ray {when}: {'; '.join(found) or 'consistent'}")

    def run(self) -> dict[str, Any]:
        twins = self.twins()
        rng = random.Random(SEED)
        count = int(self.size["fault_phase_s"] // self.size["interval_s"])
        kinds = faults.schedule(SEED, count)
        start = time.monotonic()
        due, node_back_at = start + self.size["interval_s"], None
        burst_out: dict[str, checks.Burst] = {}
        burster: threading.Thread | None = None
        self.keep_running(submit=True)
        while kinds or node_back_at is not None:
            running = self.keep_running(submit=True)
            now = time.monotonic()
            if node_back_at is not None and now >= node_back_at:
                self.cluster.add_node(**NODE)
                self.cluster.wait_for_nodes()
                node_back_at, lost = None, next(f for f in reversed(self.faults) if f.kind == "node_loss")
                lost.detail += f"; a new node added {time.time() - lost.at:.1f} s after"
                self.ctx.log(f"a new second node added ({lost.detail})")
            if burster is None and now - start >= self.size["fault_phase_s"] / 2:
                burster = threading.Thread(target=lambda: burst_out.setdefault("burst", checks.burst(
                    self.url, {f"soak-{k}": v for k, v in self.tokens.items()}, Client(self.url, self.admin_token),
                    self.size["burst"], BURST_SPEC)), daemon=True)
                burster.start()
                self.ctx.log(f"burst of {self.size['burst']} submits started")
            busy = burster is not None and burster.is_alive()
            if burster is not None and not busy and "checked" not in burst_out:
                burst_out["checked"] = checks.Burst()  # (a marker: the store is checked once after the burst)
                self.check_store("after the burst")
            if kinds and now >= due and running and not (kinds[0] == "service_sigkill" and busy) \
                    and not (kinds[0] == "node_loss" and node_back_at is not None):
                kind = kinds.pop(0)
                fault = self._inject(kind, rng, running)
                if fault is not None:
                    self.faults.append(fault)
                    self.ctx.log(f"fault {len(self.faults)} {kind}: {fault.detail}")
                    if kind == "node_loss":
                        node_back_at = time.monotonic() + faults.NODE_DOWN_S
                due = time.monotonic() + self.size["interval_s"]
            time.sleep(0.5)
        if burster is not None:
            burster.join()
        self.ctx.log("fault phase over; waiting for the last soak jobs")
        deadline = time.monotonic() + 900
        while self.current and time.monotonic() < deadline:
            self.keep_running(submit=False)
            time.sleep(1.0)
        self.check_store("at the end")
        return {"twins": twins, "burst": burst_out.get("burst")}

    def _inject(self, kind: str, rng: random.Random, running: dict[str, dict]) -> faults.Fault | None:
        if kind in faults.DRILLS:
            return faults.drill(self.admin, rng, kind, running)
        if kind == "node_loss":
            return faults.node_loss(self.cluster)
        return self.service_sigkill(running)


def run_section(ctx: BenchContext) -> list[Row]:
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"  # the local test cluster, as the tests' (the product keeps it on)
    fast_health_checks = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={**NODE, "include_dashboard": False, "_system_config": fast_health_checks})
    with ExitStack() as stack:
        stack.callback(cluster.shutdown)
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="soak-bench", log_to_driver=False)
        stack.callback(ray.shutdown)
        soak = Soak(ctx, cluster)
        try:
            out = soak.run()
            events = {job_id: soak.admin.events(job_id) for _, job_id in soak.done}
            ended = {j: job["ended_at"] for _, j in soak.done if (job := soak.admin.job(j))["status"] == "SUCCEEDED"}
            results = _losses(soak, out["twins"])
            left = checks.settled(lambda: [f"actor {a}" for a in checks.trainyard_actors()]
                                  + [f"placement group {p}" for p in checks.live_placement_groups()], 60)
        finally:
            soak.svc.__exit__(None, None, None)
    left += [f"process {p}" for p in checks.settled(lambda: [str(p) for p in checks.processes_left(os.getpid())], 60)]
    claimed = faults.evaluate(soak.faults, events, ended)
    return _rows(ctx, soak, results, out["burst"], left, faults.unplanned(claimed, events))


def _losses(soak: Soak, twins: dict[str, list[float]]) -> list[tuple[str, str, str]]:
    """(layout, job id, what is wrong or "") for every soak job."""
    out = []
    for layout, job_id in soak.done:
        job = soak.admin.job(job_id)
        losses = [r["loss"] for r in soak.admin.metrics(job_id)]
        twin = twins[layout]
        first = next((i for i, (a, b) in enumerate(zip(losses, twin, strict=False)) if a != b),
                     min(len(losses), len(twin)))
        wrong = (f"ended {job['status']}: {job['error']}" if job["status"] != "SUCCEEDED" else
                 "" if losses == twin else f"losses differ from the twin's from step {first}")
        out.append((layout, job_id, wrong))
    return out


def _rows(ctx: BenchContext, soak: Soak, results: list, burst: checks.Burst | None, left: list[str],
          unplanned: list[str]) -> list[Row]:
    rows = []
    for kind in faults.KINDS:
        of = [f for f in soak.faults if f.kind == kind]
        times = [t for f in of for t in f.recovery_s.values()]
        hits = sum(len(f.jobs) - len(f.unseen) for f in of)
        recovered = sum(len(f.recovery_s) for f in of)
        ctx.log(f"{kind}: {len(of)} faults, {recovered}/{hits} hits recovered, times {[round(t, 1) for t in times]}")
        rows.append(Row(f"soak: {kind}: fault to the next finished step of each job hit, median",
                        median(times) if times else None, None, None, "s",
                        f"{len(of)} faults, {recovered} of {hits} job hits recovered; max "
                        f"{max(times) if times else float('nan'):.1f} s" + (
                            f"; {sum(len(f.unseen) for f in of)} drills the job ended before" if kind in faults.DRILLS
                            else "")))
    hits = sum(len(f.jobs) - len(f.unseen) for f in soak.faults)
    recovered = sum(len(f.recovery_s) for f in soak.faults)
    rows.append(Row("soak: job hits recovered, all faults", recovered / hits if hits else None, None, None, "",
                    f"{recovered} of {hits}; {len(soak.faults)} faults, every {soak.size['interval_s']:g} s",
                    target=at_least(1.0)))
    wrong = [f"{layout} {job_id}: {w}" for layout, job_id, w in results if w]
    for line in wrong:
        ctx.log(f"soak job: {line}")
    rows.append(Row("soak: jobs SUCCEEDED with losses bit-identical to their twin",
                    (len(results) - len(wrong)) / len(results), None, None, "",
                    f"{len(results) - len(wrong)} of {len(results)} jobs ({', '.join(LAYOUTS)})"
                    + (f"; {'; '.join(wrong)[:300]}" if wrong else ""), target=at_least(1.0)))
    if burst is not None:
        for p in burst.problems[:20]:
            ctx.log(f"burst: {p}")
        rows.append(Row(f"soak: queued submits answered, {soak.size['burst']} from {len(LAYOUTS)} users mid-soak",
                        burst.answered, None, None, "", f"in {burst.wall_s:.1f} s, latency p50 "
                        f"{checks.p50(burst.latencies):.3f} s, p99 {checks.p99(burst.latencies):.3f} s; stopped and "
                        f"deleted in {burst.cleaned_s:.1f} s; {len(burst.problems)} problems"
                        + (f": {burst.problems[0][:200]}" if burst.problems else ""),
                        target=at_least(soak.size["burst"])))
    for line in soak.disagreements:
        ctx.log(line)
    rows.append(Row("soak: store vs Ray disagreements (after each service restart, the burst, the end)",
                    len(soak.disagreements), None, None, "", "; ".join(soak.disagreements)[:300], target=at_most(0)))
    for line in left:
        ctx.log(f"left behind: {line}")
    rows.append(Row("soak: Ray actors, placement groups and processes left behind", len(left), None, None, "",
                    "; ".join(left)[:300], target=at_most(0)))
    for line in unplanned:
        ctx.log(f"unplanned failure: {line}")
    rows.append(Row("soak: failures no fault explains", len(unplanned), None, None, "", "; ".join(unplanned)[:300]))
    return rows
