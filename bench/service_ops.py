"""Section `service`: how the service itself answers, with no training math in the measurement.

- Submit latency under a burst: 200 tiny jobs submitted at once (16 client threads) to a real
  `trainyard serve` subprocess; each submit's round trip, against one submit to the idle service (the
  ratio is the burst's median over the idle median). The jobs are admitted as they fit while the burst
  goes on, as they would be for a user; then every job is stopped.
- Exit on SIGTERM: two running jobs and one waiting, then SIGTERM; the seconds until the process exited
  (and its exit code, which must be 0).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from trainyard.cli.client import Client

from bench.context import BenchContext
from bench.results import Row, Target, ratio
from bench.service_job import BenchError, TrainyardService

BURST = 200
CLIENTS = 16
TINY = {"model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16}, "steps": 5, "global_batch": 8}


def run_section(ctx: BenchContext) -> list[Row]:
    with TrainyardService(ctx.run_dir / "burst") as svc:
        idle = [_timed_submit(svc.client, {**TINY, "name": f"idle-{i}", "steps": 1}) for i in range(10)]
        for job_id, _ in idle:
            svc.client.stop(job_id)
        clients = [Client(svc.client._http.base_url, svc.client._http.headers["Authorization"].split()[1])
                   for _ in range(CLIENTS)]
        start = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            burst = list(pool.map(lambda i: _timed_submit(clients[i % CLIENTS], {**TINY, "name": f"burst-{i}"}),
                                  range(BURST)))
        wall = time.perf_counter() - start
        jobs = {j["job_id"]: j for j in svc.client.jobs()}
        missing = [job_id for job_id, _ in burst if job_id not in jobs]
        if missing:
            raise BenchError(f"{len(missing)} submitted jobs are not listed")
        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(lambda j: clients[hash(j) % CLIENTS].stop(j), [job_id for job_id, _ in burst]))
    latencies = sorted(t for _, t in burst)
    p50, p99, idle_p50 = statistics.median(latencies), latencies[int(0.99 * len(latencies)) - 1], \
        statistics.median(t for _, t in idle)
    ctx.log(f"burst of {BURST}: p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms, "
            f"all in {wall:.2f} s; idle p50 {idle_p50 * 1e3:.1f} ms")

    with TrainyardService(ctx.run_dir / "sigterm") as svc:
        live = [svc.client.submit({**TINY, "name": f"live-{i}", "steps": 100_000}) for i in range(2)]
        svc.client.submit({**TINY, "name": "waiting", "resources": {"cpus_per_worker": 8}})
        deadline = time.monotonic() + 180
        while any(svc.client.job(j)["step"] < 1 for j in live):
            if time.monotonic() > deadline:
                raise BenchError("the jobs did not start within 180 s")
            time.sleep(0.5)
        exit_s, code = svc.terminate()
    if code != 0:
        raise BenchError(f"trainyard serve exited with {code} on SIGTERM")
    ctx.log(f"SIGTERM with 2 running jobs and 1 waiting: exited 0 after {exit_s:.2f} s")
    return [
        Row(f"submit latency p50, burst of {BURST} ({CLIENTS} clients)", p50, idle_p50, ratio(p50, idle_p50), "s",
            "baseline: one submit to the idle service", target=Target("ours", "<", 1.0)),
        Row(f"submit latency p99, burst of {BURST}", p99, None, None, "s", f"max {latencies[-1]:.3f} s"),
        Row("exit after SIGTERM, 2 running + 1 waiting job", exit_s, None, None, "s",
            "exit code 0; live jobs STOPPED, the waiting one still queued; target: a few seconds"),
    ]


def _timed_submit(client: Client, spec: dict) -> tuple[str, float]:
    start = time.perf_counter()
    job_id = client.submit(spec)
    return job_id, time.perf_counter() - start
