"""Lose a worker, lose nothing, through the real service (uvicorn, Ray, gloo): fault drills kill or hang a
rank of a (dp=2, pp=2) job that checkpoints every three steps, or kill its coordinator; the job recovers from
its latest checkpoint and ends SUCCEEDED with losses and final weights bit-identical to an uninterrupted
run, and its events list the failure and the recovery time."""

from __future__ import annotations

import pytest
import torch
from conftest import start_service
from helpers import tiny_spec, wait_for, wait_terminal
from safetensors.torch import load_file
from trainyard.parallel.export import MODEL_FILE
from trainyard.service.client import ApiError

SPEC = tiny_spec(model={"n_layer": 4}, steps=8, global_batch=8, checkpoint={"every": 3},
                 parallel={"dp": 2, "pp": 2, "microbatches": 2},
                 fault={"max_failures": 2, "hang_floor_s": 3, "from_replica": False})  # the checkpoint path
DRILLS = {"kill": ("kill_worker", 1), "hang": ("hang_worker", 2), "coordinator": ("kill_coordinator", 0)}


def _run(client, drill: tuple[str, int] | None) -> tuple[dict, list[dict]]:
    job_id = client.submit(SPEC)
    if drill is not None:
        wait_for(lambda: client.job(job_id)["status"] == "RUNNING", 120, "the job to run")
        client._call("POST", f"/api/jobs/{job_id}/faults", json={"kind": drill[0], "rank": drill[1], "at_step": 4})
    job = wait_terminal(client, job_id, timeout_s=300)
    assert job["status"] == "SUCCEEDED", job["error"]
    return job, client.metrics(job_id)


@pytest.fixture(scope="module")
def runs(service) -> dict[str, tuple[dict, list[dict]]]:
    client = service.client()
    out = {"reference": _run(client, None)} | {name: _run(client, drill) for name, drill in DRILLS.items()}
    client.close()
    return out


@pytest.mark.parametrize("drill", DRILLS)
def test_the_job_recovers_bit_identically(runs, drill, client, tmp_path):
    (reference, ref_rows), (job, rows) = runs["reference"], runs[drill]
    assert [r["step"] for r in rows] == list(range(8))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]
    weights = [load_file(str(client.download_model(j["job_id"], tmp_path / f"{i}-{MODEL_FILE}")))
               for i, j in enumerate((reference, job))]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("drill", DRILLS)
def test_events_list_the_failure_and_the_recovery_time(runs, drill, client):
    job, _ = runs[drill]
    events = client._call("GET", f"/api/jobs/{job['job_id']}/events")
    failures = [e for e in events if e["kind"] == "failure"]
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert len(failures) == 1 and len(recovered) == 1
    failure = failures[0]
    if drill == "coordinator":  # no rank failed; all died with the coordinator that owned them
        assert failure["ranks"] == [] and "the coordinator died" in failure["cause"]
    else:
        assert failure["ranks"] == [DRILLS[drill][1]] or drill == "hang"  # a hang also stalls the ranks on it
        assert DRILLS[drill][1] in failure["ranks"]
    # The rank fails as it starts step 4; its peers may notice while they finish step 3 (then no step is lost).
    assert failure["restore_step"] == 3 and failure["step"] in (3, 4)
    assert failure["steps_lost"] == failure["step"] - 3
    assert ("hung" if drill == "hang" else "died") in failure["cause"]
    assert 0 < recovered[0]["recovery_s"] < 120
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [3, 6]


def test_drills_are_refused_unless_the_service_allows_them(ray_session, tmp_path):
    svc = start_service(tmp_path, allow_fault_injection=False)
    client = svc.client()
    try:
        with pytest.raises(ApiError) as info:
            client._call("POST", "/api/jobs/nosuchjob/faults", json={"kind": "kill_worker", "rank": 0})
        assert info.value.status_code == 403 and "--allow-fault-injection" in str(info.value)
    finally:
        client.close()
        svc.shutdown()


def test_a_drill_needs_a_running_job_and_an_existing_rank(runs, client):
    job, _ = runs["reference"]
    with pytest.raises(ApiError) as info:
        client._call("POST", f"/api/jobs/{job['job_id']}/faults", json={"kind": "kill_worker", "rank": 0})
    assert info.value.status_code == 409
