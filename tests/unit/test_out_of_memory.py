"""A rank or coordinator that ran out of memory is said plainly and not retried into the same wall."""

import ray
from test_coordinator_states import BUDGET_2, POINT, inputs
from trainyard.actors.calls import Failure, out_of_memory
from trainyard.actors.policies import FailureAction
from trainyard.actors.state import CallFailed, Failed, JobStatus, Running, step
from trainyard.service.live_jobs import coordinator_lost, handling_failed


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


def test_a_rank_whose_peer_went_away_logs_a_line_not_a_traceback():
    """Its error is a consequence of the peer's (the job's error and the failing rank's log name the cause)."""
    from trainyard.actors.worker import peer_lost

    assert peer_lost(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:37091: Connection "
                                  "reset by peer. This is typically caused by a remote worker hanging"))
    assert peer_lost(RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:5"))
    assert not peer_lost(RuntimeError("data.path: /data/tokens.bin holds token id 300 at offset 446"))
    assert not peer_lost(ValueError("Connection reset by peer"))  # not a collective's error
