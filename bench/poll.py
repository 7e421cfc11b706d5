"""Section `poll`: what the service's requests cost that once grew with a job: one poll of a job at steps
100-400 and at steps 19,700-20,000, and the `resume_from` check of a 2 GiB checkpoint on the submit path.

A poll is the coordinator's report (`Controller.report`: the metrics rows since the service's cursor and the
events after its event cursor), its trip through pickle (as Ray carries it), and the manager writing it to a
real SQLite store (`service.manager.apply_report`). The job is the real controller fed 20,000 steps' rows
through its `StepRecorder.record` (`actors.actions.recording`: metrics log, journal, a checkpoint event every 50
steps), without Ray workers: what is measured is the service's side, the part that grew with the job's length.
The baseline row is the poll as it was before (every row scanned for `since`, every event sent and rewritten), emulated
with the same pieces. The resume check is `JobManager.resume_point` (what `POST /api/jobs` runs) on a
checkpoint holding a sparse 2 GiB file, against hashing it as that path did before (`checkpoint.verify`).
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

from trainyard.actors.controller import Controller
from trainyard.actors.state import JobStatus
from trainyard.actors.storage import JobStorage
from trainyard.actors.telemetry import StepRow
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec
from trainyard.service.following.follow import Cursor, apply_report
from trainyard.service.manager import JobManager
from trainyard.service.store import JobRecord, JobStore

from bench.context import REPO, BenchContext
from bench.results import Row, median, ratio

STEPS, PER_POLL, POLLS = 20_000, 10, 30


def _row(step: int) -> StepRow:
    return StepRow(step=step, loss=5.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1e4, step_time_s=0.01,
                   coordinator_overhead_s=0.001, bubble_fraction=0.0, stage_forward_s=[0.003],
                   stage_backward_s=[0.006], stage_peak_activations=[1], stage_peak_activation_mb=[0.1],
                   reduce_bytes=0, cross_replica_bytes=0,
                   checkpoint_blocked_s=0.01 if (step + 1) % 50 == 0 else None)


class _Job:
    def __init__(self, where: Path):
        spec = {"model": {"n_layer": 2, "n_head": 2, "d_model": 32, "vocab_size": 256, "seq_len": 16},
                "data": {"kind": "text", "path": str(REPO / "examples" / "corpus.txt")}, "steps": STEPS}
        storage = JobStorage(checkpoint_root=str(where / "ckpt"), model_path=str(where / "model"))
        self.ctl = Controller("job", make_plan(parse_spec(spec)), None, storage, restarted=False)
        self.store = JobStore(where / "jobs.db")
        self.store.insert(JobRecord(job_id="job", name="bench", status=JobStatus.RUNNING, spec={}, steps=STEPS))
        self.cursor, self.step = Cursor(step=0), 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.ctl.recorder.record(_row(self.step))
            self.step += 1

    def poll(self, old_way: bool) -> float:
        start = time.perf_counter()
        if old_way:
            report = self.ctl.report(0, None)
            report["metrics"] = [r for r in self.ctl.rows.rows if r["step"] >= self.cursor.step]
        else:
            events_from = self.cursor.events if self.cursor.incarnation is not None else None
            report = self.ctl.report(self.cursor.step, events_from)
        apply_report(self.store, "job", pickle.loads(pickle.dumps(report)), self.cursor)
        return time.perf_counter() - start

    def polls(self, old_way: bool) -> float:
        """The median time of POLLS polls, each after PER_POLL more steps."""
        times = []
        for _ in range(POLLS):
            self.train(PER_POLL)
            times.append(self.poll(old_way))
        return median(times)


def _resume_check(ctx: BenchContext) -> Row:
    size, where = 2 << 30, ctx.run_dir / "resume"
    store = JobStore(where / "jobs.db")
    spec = {"model": {"n_layer": 2, "n_head": 2, "d_model": 32, "vocab_size": 256, "seq_len": 16},
            "data": {"kind": "text", "path": str(REPO / "examples" / "corpus.txt")}, "steps": 10}
    store.insert(JobRecord(job_id="source", name="source", status=JobStatus.SUCCEEDED, spec=spec, steps=10))
    directory = checkpoint.step_dir(where / "checkpoints" / "source", 5)
    directory.mkdir(parents=True)
    with (directory / "__0_0.distcp").open("wb") as f:
        f.truncate(size)
    digest = checkpoint._sha256(directory / "__0_0.distcp")
    (directory / checkpoint.MANIFEST).write_text(json.dumps({"step": 5, "files": {"__0_0.distcp": [size, digest]}}))
    manager = JobManager(store, data_dir=where)
    try:
        config = parse_spec({**spec, "resume_from": {"job_id": "source", "step": 5}})
        start = time.perf_counter()
        assert manager.resume_point(config) == (str(directory), 5)
        ours = time.perf_counter() - start
    finally:
        manager.shutdown()
    start = time.perf_counter()
    assert checkpoint.verify(directory) is None
    hashed = time.perf_counter() - start
    ctx.log(f"resume_from check of a 2 GiB checkpoint: {ours * 1e3:.2f} ms; hashing it: {hashed:.2f} s")
    return Row("resume_from check of a 2 GiB checkpoint on the submit path vs hashing it (before)", ours * 1e3,
               hashed * 1e3, ratio(ours, hashed), "ms", "sparse file; the coordinator now hashes it in a thread")


def run_section(ctx: BenchContext) -> list[Row]:
    rows = [_resume_check(ctx)]
    for old_way in (False, True):
        job = _Job(ctx.run_dir / ("before" if old_way else "now"))
        job.poll(old_way)
        job.train(100)
        job.poll(old_way)
        early = job.polls(old_way)
        job.train(STEPS - job.step - PER_POLL * POLLS)
        job.poll(old_way)
        late = job.polls(old_way)
        ctx.log(f"{'before' if old_way else 'now'}: poll at steps 100-400: {early * 1e3:.3f} ms, "
                f"at steps {STEPS - PER_POLL * POLLS}-{STEPS}: {late * 1e3:.3f} ms")
        name = "poll cost at steps 19,700-20,000 vs at steps 100-400" + (
            " (before: full scan and rewrite, emulated)" if old_way else "")
        rows.append(Row(name, late * 1e3, early * 1e3, ratio(late, early), "ms",
                        f"median of {POLLS} polls, {PER_POLL} new steps each; report + pickle + store writes"))
    return rows
