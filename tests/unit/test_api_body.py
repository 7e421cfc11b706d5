"""A request body the API cannot read as JSON is a 422 in the project's shape naming `body`, like any other bad
input (FastAPI's own reader made a 400 naming nothing of all but plain syntax errors), and creates nothing."""

import json

import pytest
from fastapi.testclient import TestClient
from helpers import tiny_spec
from trainyard.api.app import create_app
from trainyard.service.manager import JobManager
from trainyard.service.store import JobStore

DEEP = 100_000


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    # A manager without Ray that admits nothing: a spec's paths are resolved against the caller (the manager's
    # `confine`) before it is read, so every body here is refused before anything would be planned.
    manager = JobManager(JobStore(tmp_path_factory.mktemp("state") / "jobs.db"), admit=False)
    yield TestClient(create_app(manager=manager, token="t"), raise_server_exceptions=False)
    manager.shutdown()


def post(client: TestClient, path: str, body: bytes):
    return client.post(path, content=body, headers={"Authorization": "Bearer t", "content-type": "application/json"})


@pytest.mark.parametrize("path", ["/api/jobs", "/api/plans", "/api/jobs/x/scale"])
@pytest.mark.parametrize("body,reason", [
    (b'{"name": "caf\xe9", "steps": 1}', "not utf-8 text (invalid continuation byte)"),  # latin-1, not UTF-8
    (b"[" * DEEP + b"]" * DEEP, "nested too deeply"),
    (b'{"a": ' * DEEP + b"1" + b"}" * DEEP, "nested too deeply"),
    (b'{"steps": }', "Expecting value"),
], ids=["latin-1", "deep-arrays", "deep-objects", "syntax"])
def test_a_body_that_is_not_json_is_a_422_naming_the_body(client, path, body, reason):
    response = post(client, path, body)
    assert response.status_code == 422, response.text
    [detail] = response.json()["detail"]
    assert detail["field"] == "body" and detail["loc"][0] == "body" and detail["type"] == "json_invalid"
    assert detail["msg"].startswith("cannot read the body as JSON at character ") and reason in detail["msg"]


def test_the_character_named_is_where_the_body_stops_being_utf8(client):
    body = '{"name": "ü€", "steps": 1, "x": "'.encode() + b"\xff" + b'"}'
    characters = body.index(b"\xff") - 3  # before it: ü takes 2 bytes, € 3, each one character
    response = post(client, "/api/plans", body)
    assert response.status_code == 422
    assert f"at character {characters}: not utf-8 text (invalid start byte)" in response.json()["detail"][0]["msg"]


@pytest.mark.parametrize("field,sign", [("steps", ""), ("seed", "-"), ("optimizer.lr", "")])
def test_an_integer_of_more_digits_than_python_reads_is_a_422_naming_its_field(client, field, sign):
    """int() refuses over 4300 digits (a ValueError, which FastAPI made a 400); read as inf, the number is refused as
    every non-finite one is."""
    section, _, key = field.rpartition(".")
    text = json.dumps(tiny_spec(**({section: {key: 123456789}} if section else {key: 123456789})))
    response = post(client, "/api/jobs", text.replace("123456789", sign + "1" * 5000).encode())
    assert response.status_code == 422, response.text
    [detail] = response.json()["detail"]
    assert detail["field"] == field and detail["msg"] == "Input should be a finite number"


@pytest.mark.parametrize("path,body,field,kind", [
    ("/api/jobs", tiny_spec(steps=True), "steps", "integer"),
    ("/api/plans", tiny_spec(parallel={"dp": True}), "parallel.dp", "integer"),
    ("/api/plans", tiny_spec(optimizer={"lr": False}), "optimizer.lr", "number"),
    ("/api/jobs/x/scale", {"dp": True}, "dp", "integer"),
    ("/api/jobs/x/faults", {"kind": "kill_worker", "rank": False}, "rank", "integer"),
])
def test_a_boolean_for_a_number_is_a_422_naming_the_field(client, path, body, field, kind):
    """pydantic's lax mode read true as 1: `{"dp": true}` scaled a job to one replica."""
    response = post(client, path, json.dumps(body).encode())
    assert response.status_code == 422, response.text
    assert [(d["field"], d["loc"][0]) for d in response.json()["detail"]
            if d["msg"] == f"Input should be a valid {kind}, not a boolean"] == [(field, "body")], response.text
