"""A rank or coordinator that ran out of memory is said plainly and not retried into the same wall."""

import os
import signal
import subprocess
import sys

import pytest
import ray
from test_coordinator_states import BUDGET_2, POINT, inputs
from trainyard.actors.calls import Failure, out_of_memory
from trainyard.actors.failure_handling.policy import FailureAction
from trainyard.actors.state import CallFailed, Failed, JobStatus, Running, step
from trainyard.service.following.live_jobs import coordinator_lost, handling_failed


def test_the_signs_of_running_out_of_memory_are_read_from_the_error():
    assert out_of_memory(MemoryError())
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 "
                                      "bytes. Error code 12 (Cannot allocate memory)"))
    assert out_of_memory(RuntimeError("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory."))
    assert out_of_memory(ray.exceptions.RayTaskError("run_step", "Traceback ...", MemoryError()))
    assert not out_of_memory(RuntimeError("Connection closed by peer"))
    assert not out_of_memory(ray.exceptions.ActorDiedError())


def test_an_out_of_memory_failure_ends_the_job_whatever_the_budget():
    assert BUDGET_2.decide(0, node_lost=False, stopping=False, out_of_memory=True).action is FailureAction.RAISE
    assert BUDGET_2.decide(0, node_lost=False, stopping=False).action is FailureAction.RECOVER
    oom = Failure(cause="rank 1 failed in step 4: can't allocate memory", blamed=(1,), raised=(1,), step=4,
                  out_of_memory=(1,))
    state = step(Running(), CallFailed(oom, POINT), inputs(), BUDGET_2)
    assert isinstance(state, Failed) and state.error.endswith(oom.cause)


def test_a_coordinator_lost_to_memory_is_a_sentence_not_the_services_traceback():
    status, error = coordinator_lost(ray.exceptions.OutOfMemoryError(
        "Task was killed due to the node running low on memory.\nMemory on the node was 23.1GB / 24GB"))
    assert status is JobStatus.FAILED and error == ("the job's coordinator was killed: its node ran out of memory "
                                                    "(Ray's memory monitor): Task was killed due to the node running "
                                                    "low on memory.")
    assert coordinator_lost(ray.exceptions.ActorUnavailableError("restarting", None)) == (JobStatus.RECOVERING, None)
    status, error = coordinator_lost(ray.exceptions.ActorDiedError())
    assert status is JobStatus.FAILED and error.startswith("the job's coordinator died: The actor died")


def test_a_failure_of_the_service_s_own_handling_is_one_line_naming_the_error_not_its_traceback():
    try:
        {}["report"]
    except KeyError as e:
        error = handling_failed(e)
    assert error == ("the service failed handling this job: KeyError: 'report' (the traceback is in the service's "
                     "log)")
    assert "Traceback" not in handling_failed(RuntimeError("")) and "RuntimeError: RuntimeError" in handling_failed(
        RuntimeError(""))


def test_the_coordinator_s_own_error_fails_the_job_in_a_sentence_its_traceback_to_its_log(tmp_path, caplog):
    """An error in the coordinator's own code (here: a start point it cannot read as a path) ends the job with one
    sentence naming what it was doing and the error; the traceback is the coordinator's log's, not the job's."""
    import asyncio

    from helpers import tiny_spec
    from trainyard.actors.controller import Controller
    from trainyard.actors.storage import JobStorage
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.spec import parse_spec

    storage = JobStorage(checkpoint_root=str(tmp_path / "job"), model_path=str(tmp_path / "model"),
                         resume=(None, 5))  # type: ignore[arg-type]  # a bug's value
    ctl = Controller("job", make_plan(parse_spec(tiny_spec(steps=10))), None, storage, restarted=False)
    asyncio.run(ctl.run())
    assert ctl.state.status is JobStatus.FAILED and ctl.error is not None
    assert ctl.error == ("the job's coordinator failed while the job was PENDING (an error in trainyard, not in a "
                         "rank): TypeError: expected str, bytes or os.PathLike object, not NoneType (the traceback "
                         "is in the coordinator's log)"), ctl.error
    assert "Traceback" in caplog.text and "_start_point" in caplog.text


def test_a_coordinator_that_died_or_raised_answering_is_a_sentence():
    """Ray's text for a coordinator whose __init__ raised holds that traceback: the job's error keeps its first
    line. A poll the coordinator's own code raised in names the error, not Ray's wrapping of it."""
    died = ray.exceptions.ActorDiedError()
    died.error_msg = ("The actor died because of an error raised in its creation task, ray::Coordinator.__init__()\n"
                      "Traceback (most recent call last):\n  File \"coordinator.py\", line 45\nKeyError: 'x'")
    status, error = coordinator_lost(died)
    assert status is JobStatus.FAILED and "\n" not in error and error.startswith("the job's coordinator died: The "
                                                                                 "actor died because of an error")
    try:
        {}["report"]
    except KeyError as e:
        raised = ray.exceptions.RayTaskError("poll", "Traceback (most recent call last): ...", e)
    status, error = coordinator_lost(raised.as_instanceof_cause())
    assert status is JobStatus.FAILED and error == ("the job's coordinator failed answering the service (an error "
                                                    "in trainyard, not in a rank): KeyError: 'report' (the traceback "
                                                    "is in the coordinator's log)")


def test_a_rank_whose_peer_went_away_logs_a_line_not_a_traceback():
    """Its error is a consequence of the peer's (the job's error and the failing rank's log name the cause)."""
    from trainyard.actors.worker_group.worker import peer_lost

    assert peer_lost(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:37091: Connection "
                                  "reset by peer. This is typically caused by a remote worker hanging"))
    assert peer_lost(RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:5"))
    assert not peer_lost(RuntimeError("data.path: /data/tokens.bin holds token id 300 at offset 446"))
    assert not peer_lost(ValueError("Connection reset by peer"))  # not a collective's error


# Ray's word (ray 2.x) for an actor whose process was SIGKILLed, as a test that kills one itself reads it: the same
# for os._exit and a segfault, so only the OOM-kill counts tell the OOM killer apart.
SIGKILLED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: Worker\n\tpid: 16640\nThe "
             "actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
             "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) "
             "the process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or "
             "(3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")
SIGTERMED = ("The actor died unexpectedly before finishing this task. Worker exit type: SYSTEM_ERROR Worker exit "
             "detail: Worker exits unexpectedly. Worker exits with an exit code 1. The process receives a SIGTERM.")
KILLED_BY_RAY = "The actor died because of ray.kill. Worker exit type: INTENDED_USER_EXIT Worker exit detail: ..."


def test_a_sigkilled_rank_is_out_of_memory_when_its_oom_kill_count_rose():
    from trainyard.actors.worker_group.oom_killer import OomCounts, oom_killed

    before = OomCounts(kernel=3, cgroup=0, cgroup_path="v1:/job")
    assert "oom_kill count of its memory cgroup (v1:/job) rose from 0 to 1" in oom_killed(
        SIGKILLED, before, OomCounts(kernel=4, cgroup=1, cgroup_path="v1:/job"))
    # the cgroup's count decides when both readings have it: another container's kill is not this rank's
    assert oom_killed(SIGKILLED, before, OomCounts(kernel=4, cgroup=0, cgroup_path="v1:/job")) is None
    # no cgroup count (not readable): the kernel's decides
    assert "/proc/vmstat) rose from 3 to 4" in oom_killed(SIGKILLED, OomCounts(kernel=3), OomCounts(kernel=4))
    assert oom_killed(SIGKILLED, OomCounts(kernel=3), OomCounts(kernel=3)) is None  # a crash (os._exit, SIGSEGV)
    # not a SIGKILL: a SIGTERM, ray.kill, or no reading on one side (the node lost, or never read)
    assert oom_killed(SIGTERMED, OomCounts(kernel=3), OomCounts(kernel=4)) is None
    assert oom_killed(KILLED_BY_RAY, OomCounts(kernel=3), OomCounts(kernel=4)) is None
    assert oom_killed(SIGKILLED, None, OomCounts(kernel=4)) is None
    assert oom_killed(SIGKILLED, OomCounts(kernel=3), None) is None


def test_a_kernel_oom_kill_of_a_confined_process_raises_its_cgroup_s_count():
    """A real OOM kill: a child process confined to 32 MiB of new memory asks for 256 MiB and the kernel SIGKILLs
    it (nothing else on the machine is short of memory). Needs a writable memory cgroup (root here)."""
    from trainyard.actors.worker_group.oom_killer import (
        OomCounts,
        child_cgroup,
        memory_cgroup,
        oom_killed,
        read_oom_counters,
    )

    name = f"trainyard-test-{os.getpid()}"
    if child_cgroup(name) is None or os.geteuid() != 0:
        pytest.skip("no memory cgroup of this process to confine a child in")
    before = read_oom_counters()
    try:
        directory = memory_cgroup(32 << 20, name)
    except OSError as e:
        pytest.skip(f"memory cgroups are not writable here: {e}")
    try:
        script = (f"import os, sys; open({str(directory / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
                  "bytearray(256 << 20); sys.exit(3)")
        child = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, timeout=60)
        assert child.returncode == -signal.SIGKILL, child.stderr.decode()  # no Python error
        after = read_oom_counters()  # (v1 counts sum the subtree: read before the cgroup goes)
    finally:
        directory.rmdir()
    assert after["cgroup"] is not None and after["cgroup"] > before["cgroup"], (before, after)
    assert "oom_kill count of its memory cgroup" in oom_killed(SIGKILLED, OomCounts(**before), OomCounts(**after))
    assert oom_killed(SIGKILLED, OomCounts(**after), OomCounts(**read_oom_counters())) is None  # nothing since
