"""A job goes on from the latest checkpoint whose steps all have their rows: a checkpoint is committed by the ranks
during a step, before the coordinator appends that step's metrics row, so a process killed in between leaves a
checkpoint ahead of the rows (seen: `trainyard serve` SIGKILLed after the checkpoint of step 50 and before step
49's row; the job went on from 50 and never had a row for step 49)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from helpers import tiny_spec
from trainyard.actors.calls import Unrecoverable
from trainyard.actors.controller import Controller
from trainyard.actors.journal import append_metrics_log, steps_logged
from trainyard.actors.storage import JobStorage
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec


def committed(root: Path, step: int) -> None:
    directory = checkpoint.step_dir(root, step)
    directory.mkdir(parents=True)
    data = f"state after {step} steps".encode()
    (directory / "__0_0.distcp").write_bytes(data)
    manifest = {"step": step, "files": {"__0_0.distcp": [len(data), hashlib.sha256(data).hexdigest()]}}
    (directory / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def job_root(tmp_path: Path, rows_through: int) -> Path:
    """Checkpoints of steps 40 and 50, and rows for steps 0..rows_through."""
    root = tmp_path / "checkpoints" / "job"
    for step in (40, 50):
        committed(root, step)
    for step in range(rows_through + 1):
        append_metrics_log(root, {"step": step, "loss": 1.0})
    return root


def test_a_checkpoint_ahead_of_the_rows_is_passed_over(tmp_path):
    assert steps_logged(tmp_path) is None  # no log: no bound
    assert steps_logged(job_root(tmp_path / "a", 48)) == 49
    assert steps_logged(job_root(tmp_path / "b", 49)) == 50


def test_a_restarted_coordinator_goes_on_from_the_last_checkpoint_the_rows_reach(tmp_path):
    """(The service's admission of a job its restart interrupted takes the same bound: tests/e2e/test_serve_process.py
    checks that job's rows, every step's once, after a SIGKILL.)"""
    for rows_through, expected in ((48, 40), (49, 50)):
        where = tmp_path / str(rows_through)
        root = job_root(where, rows_through)
        storage = JobStorage(checkpoint_root=str(root), model_path=str(where / "model"))
        ctl = Controller("job", make_plan(parse_spec(tiny_spec(steps=100))), None, storage, restarted=True)
        assert ctl.restore_point() == (str(checkpoint.step_dir(root, expected)), expected)


def damage(root: Path, step: int) -> None:
    """The checkpoint's bytes changed, its sizes kept (a bad disk, a torn copy)."""
    shard = checkpoint.step_dir(root, step) / "__0_0.distcp"
    shard.write_bytes(bytes(b ^ 0xFF for b in shard.read_bytes()))


def test_a_recovery_passes_over_a_damaged_checkpoint_and_says_so(tmp_path):
    root = job_root(tmp_path, 60)
    damage(root, 50)
    storage = JobStorage(checkpoint_root=str(root), model_path=str(tmp_path / "model"))
    ctl = Controller("job", make_plan(parse_spec(tiny_spec(steps=100))), None, storage, restarted=False)
    assert ctl.restore_point() == (str(checkpoint.step_dir(root, 40)), 40)
    [event] = [e for e in ctl.journal.events if e["kind"] == "checkpoint_damaged"]
    assert event["restore_step"] == 40 and event["damaged"][0].startswith("step 50: ")


def test_resume_from_a_jobs_damaged_newest_checkpoint_starts_from_the_one_before(tmp_path):
    """`resume_from: {job_id}` (no step) names the source's newest: damaged, its newest intact one before it is
    taken, with an event; a step named explicitly is never replaced."""
    source = job_root(tmp_path / "source", 60)
    damage(source, 50)
    newest = (str(checkpoint.step_dir(source, 50)), 50)
    plan = make_plan(parse_spec(tiny_spec(steps=100)))
    for falls_back in (True, False):
        where = tmp_path / str(falls_back)
        storage = JobStorage(checkpoint_root=str(where / "checkpoints"), model_path=str(where / "model"),
                             resume=newest, resume_falls_back=falls_back)
        ctl = Controller("job", plan, None, storage, restarted=False)
        if falls_back:
            assert ctl._start_point() == (str(checkpoint.step_dir(source, 40)), 40) and ctl.progress.start_step == 40
            [event] = [e for e in ctl.journal.events if e["kind"] == "checkpoint_damaged"]
            assert event["restore_step"] == 40 and event["damaged"][0].startswith("step 50: ")
        else:
            with pytest.raises(Unrecoverable, match="is damaged"):
                ctl._start_point()
