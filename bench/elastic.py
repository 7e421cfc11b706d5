"""Section `elastic`: how long a running job pauses when it is resized (`POST /api/jobs/{id}/scale {dp}`).

A small GPT job (4 layers, d_model 64, seq_len 32, global batch 8 in micro-batches of 2 sequences, pp=1)
runs through a real `trainyard serve` subprocess (embedded Ray: max(cores, 8) = 8 logical CPUs, so dp=4 fits
at one CPU per worker). It starts at dp=2; after 10 steps it is resized to dp=4, and 10 steps after that back
to dp=2. The job writes a `resize` event per resize; the rows are its `paused_s`, the seconds from the step
boundary where the resize began until the new layout was ready to train: ranks kept, killed or created, the
process groups formed again, the state moved. With `parallel.zero: 0` the state moves in memory (kept ranks
keep theirs, added ranks get it by broadcast from data-parallel rank 0); with `zero: 1` (optimizer state
sharded over dp) it goes through a checkpoint of that step. Each variant runs `ctx.rounds` jobs (at most 3);
every job must end SUCCEEDED with the losses of the same spec run at a fixed dp=2, within 1e-4 relative at
every step (a different dp sums the gradients in another order).
"""

from __future__ import annotations

import time
from typing import Any

from trainyard.cli.client import ApiError, Client

from bench.context import BenchContext
from bench.results import Row, at_most, median
from bench.service_job import BenchError, TrainyardService, wait_job

SPEC: dict[str, Any] = {
    "name": "elastic", "seed": 5,
    "model": {"n_layer": 4, "n_head": 2, "d_model": 64, "seq_len": 32},
    "steps": 300, "global_batch": 8,
    "parallel": {"dp": 2, "microbatches": 2},
}
VARIANTS = ((0, "memory"), (1, "checkpoint"))  # parallel.zero -> how the state moves
RESIZES = (4, 2)  # from dp=2: to 4, then back to 2
STEPS_BETWEEN = 10
"""Steps trained before the first resize and between the two."""
TOLERANCE = 1e-4
"""Largest relative difference of a step's loss from the fixed-size run's."""
TARGET_S = 5.0


def run_section(ctx: BenchContext) -> list[Row]:
    rounds = min(3, ctx.rounds or 3)
    rows = []
    with TrainyardService(ctx.run_dir / "serve") as svc:
        for zero, moved in VARIANTS:
            spec = {**SPEC, "name": f"elastic-zero{zero}", "parallel": {**SPEC["parallel"], "zero": zero}}
            reference = [r["loss"] for r in svc.run_job(spec)]
            paused: dict[int, list[float]] = {dp: [] for dp in RESIZES}
            waited: dict[int, list[float]] = {dp: [] for dp in RESIZES}
            for i in range(rounds):
                for event in _resized_run(svc.client, spec, reference, moved):
                    paused[event["to"]["dp"]].append(event["paused_s"])
                    waited[event["to"]["dp"]].append(event["waited_s"])
                    ctx.log(f"zero {zero} round {i}: dp {event['from']['dp']} -> {event['to']['dp']} at step "
                            f"{event['step']} through {event['moved']}: paused {event['paused_s']:.2f} s "
                            f"(asked {event['waited_s']:.2f} s before the step boundary)")
            previous = SPEC["parallel"]["dp"]
            for dp in RESIZES:
                values = ", ".join(f"{v:.2f}" for v in paused[dp])
                rows.append(Row(f"resize dp {previous} -> {dp}, state through {moved} (zero {zero}): pause",
                                median(paused[dp]), None, None, "s",
                                f"median of {rounds}: {values}; request to step "
                                f"boundary median {median(waited[dp]):.2f} s", target=at_most(TARGET_S)))
                previous = dp
    return rows


def _resized_run(client: Client, spec: dict[str, Any], reference: list[float], moved: str) -> list[dict]:
    """Run `spec`, resized as RESIZES says; check its resize events and losses; return the resize events."""
    job_id = client.submit(spec)
    at = STEPS_BETWEEN
    for count, dp in enumerate(RESIZES, start=1):
        wait_job(client, job_id, lambda j, s=at: j["status"] == "RUNNING" and j["step"] >= s, f"step {at}")
        _scale(client, job_id, dp)
        deadline = time.monotonic() + 120
        while len(events := [e for e in client.events(job_id) if e["kind"] == "resize"]) < count:
            if time.monotonic() > deadline:
                raise BenchError(f"job {job_id}: no resize to dp={dp} within 120 s")
            time.sleep(0.2)
        at = events[-1]["step"] + STEPS_BETWEEN
    job = wait_job(client, job_id, lambda j: j["status"] in ("SUCCEEDED", "FAILED", "STOPPED"), "its end",
                   timeout_s=600, poll_s=0.5)
    if job["status"] != "SUCCEEDED":
        raise BenchError(f"job {job_id} ended {job['status']} after resizing: {job['error']}")
    if [(e["to"]["dp"], e["moved"]) for e in events] != [(dp, moved) for dp in RESIZES]:
        raise BenchError(f"job {job_id}: resizes {[(e['to']['dp'], e['moved']) for e in events]}, expected "
                         f"{[(dp, moved) for dp in RESIZES]}")
    losses = [r["loss"] for r in client.metrics(job_id)]
    if len(losses) != len(reference):
        raise BenchError(f"job {job_id}: {len(losses)} steps recorded, the fixed-size run {len(reference)}")
    for step, (loss, ref) in enumerate(zip(losses, reference, strict=True)):
        if abs(loss - ref) > TOLERANCE * abs(ref):
            raise BenchError(f"job {job_id}: step {step} loss {loss!r}, the fixed-size run's {ref!r} (more than "
                             f"{TOLERANCE:g} relative)")
    return events


def _scale(client: Client, job_id: str, dp: int, timeout_s: float = 30.0) -> None:
    """Ask for the resize; a 409 while the job is still settling from the previous one is asked again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.scale(job_id, dp)
            return
        except ApiError as e:
            if e.status_code != 409 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
