"""No checkpoint is hashed where it would block: the service (the API's submit path for `resume_from`, the
admission thread) checks a checkpoint's files and sizes only, and the coordinator hashes it in a thread, its
event loop answering polls meanwhile. The checkpoint here holds a sparse file of 2 GiB (written in no time),
whose manifest's digest is wrong: only hashing can tell."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from helpers import tiny_spec
from trainyard.actors.calls import Unrecoverable
from trainyard.actors.controller import Controller
from trainyard.actors.state import JobStatus, Pending
from trainyard.actors.storage import JobStorage
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.spec import parse_spec
from trainyard.service.manager import JobManager
from trainyard.service.store import JobRecord, JobStore

GiB = 1 << 30


def big_checkpoint(root: Path, step: int, size: int = 2 * GiB) -> Path:
    """A committed checkpoint directory of `step` with one sparse file of `size` bytes and a wrong digest."""
    directory = checkpoint.step_dir(root, step)
    directory.mkdir(parents=True)
    with (directory / "__0_0.distcp").open("wb") as f:
        f.truncate(size)
    manifest = {"step": step, "files": {"__0_0.distcp": [size, "0" * 64]}}
    (directory / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return directory


@pytest.fixture()
def manager(tmp_path):
    """The real JobManager over a real store; no job runs, so its threads need no Ray."""
    store = JobStore(tmp_path / "jobs.db")
    spec = tiny_spec(steps=10)
    store.insert(JobRecord(job_id="source", name="source", status=JobStatus.SUCCEEDED, spec=spec, steps=10))
    m = JobManager(store, data_dir=tmp_path)
    yield m
    m.shutdown()


def test_resume_from_is_checked_without_hashing(manager, tmp_path):
    directory = big_checkpoint(tmp_path / "checkpoints" / "source", 5)
    for wanted in ({"job_id": "source", "step": 5}, {"job_id": "source"}):
        config = parse_spec(tiny_spec(steps=10, resume_from=wanted))
        assert manager.resume_point(config) == (str(directory), 5)  # the wrong digest went unread


def test_the_coordinator_hashes_in_a_thread_and_answers_polls_meanwhile(tmp_path):
    directory = big_checkpoint(tmp_path / "source", 5, size=GiB // 8)  # seconds to hash; not one loop pass
    storage = JobStorage(checkpoint_root=str(tmp_path / "job"), model_path=str(tmp_path / "model"),
                         resume=(str(directory), 5))
    ctl = Controller("job", make_plan(parse_spec(tiny_spec(steps=10))), None, storage, restarted=False)

    async def scenario():
        verifying = asyncio.ensure_future(ctl._act(Pending()))  # PENDING's action: verify the start point
        await asyncio.sleep(0)  # the verification has begun in its thread
        answered = ctl.report(0, None)  # a poll, answered by the event loop meanwhile
        in_flight = not verifying.done()
        with pytest.raises(Unrecoverable, match="does not match its checksum"):
            await verifying
        return answered, in_flight

    answered, in_flight = asyncio.run(scenario())
    assert answered["status"] == "PENDING" and in_flight


@pytest.mark.parametrize("optimizer,refused", [({"offload": True}, None),
                                               ({"kind": "sgd"}, "optimizer.kind: 'adamw' there, 'sgd' here")])
def test_resume_from_may_offload_the_optimizer_but_not_change_it(manager, tmp_path, optimizer, refused):
    # where the state lives changes no number (tests/integration/test_optimizers_gloo.py): a job out of memory
    # may go on from its checkpoint with the optimizer offloaded
    directory = big_checkpoint(tmp_path / "checkpoints" / "source", 5, size=16)
    config = parse_spec(tiny_spec(steps=10, optimizer=optimizer, resume_from={"job_id": "source"}))
    if refused is None:
        assert manager.resume_point(config) == (str(directory), 5)
    else:
        with pytest.raises(PlanError, match=refused):
            manager.resume_point(config)
