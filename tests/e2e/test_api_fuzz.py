"""(`make test-slow`.) Fuzzing the API from its own OpenAPI schema (schemathesis): no request, valid or not, gets a 5xx.

The service under test is real (uvicorn, the manager, Ray) but admits nothing, so the specs the fuzzer
manages to make valid are queued and never train. Half the examples of an operation on one job use a job
that exists (random ids would only ever reach the 404), so its query parameters reach the store. Each
operation gets a bounded number of valid-shaped and of invalid examples, derandomised, so the test takes
well under a minute and fails the same way twice.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from conftest import start_service
from helpers import SLOW, SLOW_TESTS, tiny_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

EXAMPLES = 60 if SLOW_TESTS else 8
"""Per operation and generation mode (it was 100, then 50, 30, 15: the suite's budget; `make test-slow` runs four
times as many; derandomised: the same each run)."""

pytestmark = SLOW  # its own service and some 300 requests: about 30 s of make test's budget


@pytest.fixture(scope="module")
def fuzzed_service(ray_session, tmp_path_factory):
    """Its node type's costs are in the calibration cache already, so `parallel: auto` specs reach the planner
    (without, they are a 503 while the costs are measured: tests/unit/test_calibration_in_background.py)."""
    from trainyard.parallel.plan.planner.calibration import CACHE_FILE, node_type
    from trainyard.parallel.plan.planner.machine_costs import default_gpu_costs
    from trainyard.service.ray_runtime import cluster_resources

    state = tmp_path_factory.mktemp("fuzz")
    key = node_type(cluster_resources())
    (state / CACHE_FILE).write_text(json.dumps({key: default_gpu_costs(key).to_dict()}))
    svc = start_service(state, admit=False, allow_fault_injection=False)
    yield svc
    svc.shutdown()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_request_gets_a_server_error(fuzzed_service, mode):
    schema = schemathesis.openapi.from_url(f"{fuzzed_service.url}/openapi.json")
    auth = {"Authorization": f"Bearer {fuzzed_service.token}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /api/jobs", "GET /api/jobs/{job_id}/metrics", "POST /api/plans",
                                               "DELETE /api/jobs/{job_id}", "POST /api/jobs/{job_id}/stop"}
    client = fuzzed_service.client()
    existing = {"id": client.submit(tiny_spec())}

    def a_real_job() -> str:
        if client._http.get(f"/api/jobs/{existing['id']}").status_code == 404:  # a fuzzed DELETE took it
            existing["id"] = client.submit(tiny_spec())
        return existing["id"]

    sent: dict[str, int] = {}
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode), real_job=st.booleans())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def no_server_error(case, real_job: bool) -> None:
            if real_job and "job_id" in (case.path_parameters or {}):
                case.path_parameters["job_id"] = a_real_job()
            response = case.call(headers=auth)
            sent[case.operation.label] = sent.get(case.operation.label, 0) + 1
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} {case.body!r} -> {response.status_code}: {response.text}")

        try:
            no_server_error()
        except Unsatisfiable:  # no invalid request exists for an operation without inputs (GET /healthz)
            assert mode is GenerationMode.NEGATIVE
    assert sent["POST /api/jobs"] >= EXAMPLES // 2 and sent["GET /api/jobs/{job_id}/metrics"] >= EXAMPLES // 2, sent


SPEC = {"model": {"n_layer": 2, "n_head": 2, "d_model": 32}, "steps": 3}
HF = {"n_layer": 2, "n_head": 2, "d_model": 32, "family": "hf"}


@pytest.mark.parametrize("path,body,field,text", [
    ("/api/jobs", {**SPEC, "steps": 10**30}, "steps", "less than or equal to 1000000000"),
    ("/api/jobs", {**SPEC, "steps": 2**63}, "steps", "less than or equal to 1000000000"),
    ("/api/jobs", {**SPEC, "global_batch": 10**18}, "global_batch", "less than or equal to 16777216"),
    ("/api/jobs", {**SPEC, "parallel": {"dp": 2**62}, "global_batch": 8}, "parallel.dp", "less than or equal to 65536"),
    ("/api/jobs", {**SPEC, "parallel": {"dp": 2**16}, "global_batch": 2**16}, "parallel.dp", "can ever hold only 8"),
    ("/api/plans", {**SPEC, "sim_costs": {"forward": 1e308}}, "sim_costs.forward", "less than or equal to 1000000"),
    ("/api/jobs", '{"model": {"n_layer": 2, "n_head": 2, "d_model": 32}, "steps": 3, "fault": {"step_timeout_s": '
                  'Infinity}}', "fault.step_timeout_s", "finite number"),
    ("/api/plans", '{"model": {"n_layer": 2, "n_head": 2, "d_model": 32}, "steps": 3, "sim_costs": {"comm": '
                   'Infinity}}', "sim_costs.comm", "finite number"),
    # family hf with an hf_config that is no config.json reached the planner's counting (a JSONDecodeError: 500)
    ("/api/plans", {**SPEC, "model": {**HF, "hf_config": "not json"}}, "model.hf_config", "is not JSON"),
    ("/api/jobs", {**SPEC, "parallel": "auto", "model": {**HF, "hf_config": "[]"}}, "model.hf_config", "not an object"),
    ("/api/jobs", {**SPEC, "parallel": "auto", "model": {**HF, "hf_config": '{"model_type": "nonexistent"}'}},
     "init_from.hf", "give init_from.hf"),
    # parallel: auto is told the rules no layout changes, as a fixed layout is, before the planner runs
    ("/api/jobs", {**SPEC, "parallel": "auto", "model": {**SPEC["model"], "seq_len": 64, "context_len": 1}},
     "model.seq_len", "exceeds the model context"),
    # an elastic range whose max no micro-batch reaches was accepted and stayed at dp=1
    ("/api/jobs", {**SPEC, "parallel": {"dp": {"min": 1, "max": 3}}, "global_batch": 8}, "parallel.dp",
     "can reach 1, 2"),
])
def test_the_requests_that_once_got_500_are_422_naming_the_field(fuzzed_service, path, body, field, text):
    http = fuzzed_service.client()._http
    raw = isinstance(body, str)  # JSON with Infinity, which httpx's json= would refuse to send
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if raw else {"json": body}
    response = http.post(path, **kwargs)
    assert response.status_code == 422, response.text
    assert any(d["field"] == field and text in d["msg"] for d in response.json()["detail"]), response.json()


@pytest.mark.parametrize("since,status", [(10**30, 422), (-1, 422), (2**63, 422), (0, 200), (10**9, 200)])
def test_metrics_since_is_bounded(fuzzed_service, since, status):
    client = fuzzed_service.client()
    job_id = client.submit(tiny_spec())
    response = client._http.get(f"/api/jobs/{job_id}/metrics", params={"since": since})
    assert response.status_code == status, response.text
    if status == 422:
        assert response.json()["detail"][0]["field"] == "query.since"
