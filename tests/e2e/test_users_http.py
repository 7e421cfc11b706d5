"""Two users and the admin over HTTP (a real uvicorn, manager and Ray): each user sees and controls only their own
jobs, whatever request the fuzzer makes of the other's (it answers as a missing job, a 404, never a 5xx), and no
2xx of the fuzzer's reads a path outside the user's data roots; the admin sees and controls both; a user's quota
holds their second job in the queue while another user's job is admitted, and holds a resize too."""

from __future__ import annotations

import json

import pytest
import schemathesis
from conftest import start_service
from helpers import REPO, tiny_spec, wait_for
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from trainyard.cli.client import ApiError, Client
from trainyard.service.tenancy import users
from trainyard.service.tenancy.access import resolve

EXAMPLES = 3
"""Per operation and user (derandomised): the request shapes the schema allows, each on the other user's job."""
EXAMPLES_DIR = str((REPO / "examples").resolve())
ROOTS = users.Limits(data_roots=(EXAMPLES_DIR,))
"""Each user's data root: the examples, which `tiny_spec` trains on."""


def paths_read(spec: dict) -> set[str]:
    """The data roots of the paths a spec names that the service would read (each resolved)."""
    data, init = spec.get("data") or {}, spec.get("init_from") or {}
    named = [data.get("path"), data.get("val_path"), init.get("hf"), init.get("adapter")]
    named += [s.get("path") for s in data.get("sources") or [] if isinstance(s, dict)]
    return {EXAMPLES_DIR if str(resolve(p)).startswith(EXAMPLES_DIR) else str(resolve(p))
            for p in named if isinstance(p, str)}


def calibrated_state(tmp_path_factory):
    """A state directory whose node type's costs are known, so `parallel: auto` specs are planned at submit (and
    no calibration runs in the background)."""
    from trainyard.parallel.plan.planner.calibration import CACHE_FILE, node_type
    from trainyard.parallel.plan.planner.machine_costs import default_gpu_costs
    from trainyard.service.ray_runtime import cluster_resources

    state = tmp_path_factory.mktemp("users")
    key = node_type(cluster_resources())
    (state / CACHE_FILE).write_text(json.dumps({key: default_gpu_costs(key).to_dict()}))
    return state


@pytest.fixture(scope="module")
def two_users(ray_session, tmp_path_factory):
    """A service that admits nothing, alice and bob made after it started (no restart needed), a job of each."""
    state = calibrated_state(tmp_path_factory)
    svc = start_service(state, admit=False)
    tokens = {name: users.create(state, name, limits=ROOTS) for name in ("alice", "bob")}
    clients = {name: Client(svc.url, token) for name, token in tokens.items()}
    jobs = {name: clients[name].submit(tiny_spec(name=f"{name}-job")) for name in tokens}
    yield svc, tokens, clients, jobs, schemathesis.openapi.from_url(f"{svc.url}/openapi.json")
    for client in clients.values():
        client.close()
    svc.shutdown()


@pytest.mark.parametrize("user, other", [("alice", "bob"), ("bob", "alice")])
def test_a_user_never_reaches_the_other_users_job_and_gets_no_server_error(two_users, user, other):
    svc, tokens, clients, jobs, schema = two_users
    auth = {"Authorization": f"Bearer {tokens[user]}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    on_a_job = [op for op in operations if "{job_id}" in op.path]
    assert len(on_a_job) >= 9, [op.label for op in on_a_job]
    answers: dict[str, set[int]] = {}
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def no_access(case) -> None:
            if "job_id" in (case.path_parameters or {}):
                case.path_parameters["job_id"] = jobs[other]
            response = case.call(headers=auth)
            answers.setdefault(case.operation.label, set()).add(response.status_code)
            assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.text}"
            if "job_id" in (case.path_parameters or {}):
                assert response.status_code == 404, f"{case.method} {case.formatted_path} -> {response.text}"
            assert jobs[other] not in response.text or response.status_code == 404, response.text
            if response.status_code < 300 and case.method == "POST" and isinstance(case.body, dict):
                assert paths_read(case.body) <= {EXAMPLES_DIR}, (case.body, response.text)

        no_access()
    assert all(answers[op.label] == {404} for op in on_a_job), answers
    mine = clients[user].jobs()
    assert mine and {j["owner"] for j in mine} == {user} and jobs[user] in {j["job_id"] for j in mine}
    assert clients[user].job(jobs[user])["owner"] == user
    assert clients[other].job(jobs[other])["status"] == "PENDING"  # the fuzzer's stops and deletes did nothing


def test_the_admin_sees_and_controls_every_users_jobs(two_users):
    svc, tokens, clients, jobs, _ = two_users
    admin = svc.client()
    listed = {j["job_id"]: j["owner"] for j in admin.jobs()}
    assert listed[jobs["alice"]] == "alice" and listed[jobs["bob"]] == "bob"
    assert admin.events(jobs["bob"]) == [] and admin.metrics(jobs["alice"]) == []
    assert admin.stop(jobs["alice"])["status"] == "STOPPED"
    admin.delete(jobs["alice"])
    with pytest.raises(ApiError) as info:
        clients["alice"].job(jobs["alice"])
    assert info.value.status_code == 404
    with pytest.raises(ApiError) as info:
        Client(svc.url, tokens["alice"] + "x").jobs()
    assert info.value.status_code == 401
    admin.close()


def test_a_quota_holds_a_users_second_job_while_another_users_job_is_admitted(ray_session, tmp_path_factory):
    state = calibrated_state(tmp_path_factory)
    svc = start_service(state, allow_fault_injection=False)
    alice, bob = (Client(svc.url, users.create(state, name, max_cpus=1, limits=ROOTS)) for name in ("alice", "bob"))
    try:
        with pytest.raises(ApiError) as info:  # 2 ranks of 1 CPU: more than all of alice's quota
            alice.submit(tiny_spec(parallel={"dp": 2}))
        assert info.value.status_code == 422 and "resources: the job needs 2 cpus at once" in str(info.value)
        assert alice.jobs() == []

        spec = tiny_spec(steps=100_000, fault={"max_failures": 0}, parallel={"microbatches": 2})  # dp=2 splits it
        first, second = alice.submit(spec), alice.submit(spec)
        other = bob.submit(spec)
        wait_for(lambda: bob.job(other)["admitted_at"] is not None, 60, "bob's job to be admitted")
        held = wait_for(lambda: [e for e in alice.events(second) if e["kind"] == "waiting_for_quota"], 30,
                        "alice's second job to say it waits for her quota")
        assert "hold 1 of their 1 cpus and this job needs 1 more" in held[0]["cause"]
        job = alice.job(second)
        assert job["admitted_at"] is None and "the user's quota" in job["waiting_for"]["reason"]
        assert alice.job(first)["admitted_at"] is not None
        with pytest.raises(ApiError) as info:  # a resize is held to the quota too: beyond all of it, a 422
            alice.scale(first, 2)
        assert info.value.status_code == 422 and "dp: the job needs 2 cpus at once" in str(info.value)
        with pytest.raises(ApiError) as info:  # ... beyond what her running job leaves, a 409
            alice.scale(second, 1)
        assert info.value.status_code == 409 and "the user's quota: their running jobs hold 1" in str(info.value)
    finally:
        # The jobs never need to train: their coordinators are killed (and their ranks with them) rather than
        # stopped at a step boundary, which waits for the ranks to start (4 s on two cores).
        for job_id in svc.manager.live.snapshot()[0]:
            svc.manager.live.release(job_id)
        for client in (alice, bob):
            client.close()
        svc.shutdown()
