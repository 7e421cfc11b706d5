"""A shared service no user sees past, over HTTP (a real uvicorn, manager and Ray), as a second user would try it:
every path field of a spec confined to the user's data roots, uploads and jobs' outputs (`~`, `..`, a symlink, a
link inside a directory, the state directory, another user's root and upload), each refused with the one answer a
missing path gets; another user's job ids answer as missing ones on every route and in `resume_from` and
`init_from`; priorities, queue limits, elastic growth, tiny CPU requests and trackers held to the user's limits; a
request without a token answered before its body is read. Ordinary use works: a job on an uploaded file and one on
a file under a data root SUCCEED, their models download, a job starts from one of the user's own jobs, and a
deleted job's files go with it.

Two services share the session's Ray: one that admits nothing (every refusal and the queue, no job runs) and one
that runs the two small jobs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tarfile
from pathlib import Path

import httpx
import pytest
from conftest import start_service
from helpers import REPO, tiny_spec, wait_terminal
from trainyard.cli.client import ApiError, Client
from trainyard.service.tenancy import users

CORPUS = REPO / "examples" / "corpus.txt"
MISSING_JOB = "0123456789ab"


@pytest.fixture(scope="module")
def yard(ray_session, tmp_path_factory):
    """A service that admits nothing; alice and bob, each with a data root holding a copy of the corpus, and carol
    (limits, no roots); alice's symlinks out of her root; a queued job of alice's."""
    base = tmp_path_factory.mktemp("tenancy")
    state = base / "state"
    roots = {name: base / f"{name}-data" for name in ("alice", "bob", "carol")}
    for root in roots.values():
        root.mkdir()
        shutil.copy(CORPUS, root / "corpus.txt")
    svc = start_service(state, admit=False)
    limits = {"carol": {"max_cpus": 2, "max_queued": 2}}
    tokens = {name: users.create(state, name, limits=users.Limits(data_roots=(str(roots[name]),),
                                                                   **limits.get(name, {}))) for name in roots}
    (roots["alice"] / "to-token").symlink_to(state / "token")
    (roots["alice"] / "linked-dir").mkdir()
    (roots["alice"] / "linked-dir" / "inner").symlink_to(state / "token")
    (roots["alice"] / "to-bob").symlink_to(roots["bob"])
    http = {name: httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
            for name, token in tokens.items()}
    queued = http["alice"].post("/api/jobs", json=spec_of(roots["alice"]))
    assert queued.status_code == 201, queued.text
    yield svc, roots, tokens, http, queued.json()["job_id"]
    for client in http.values():
        client.close()
    svc.shutdown()


def refusal(response: httpx.Response) -> tuple[int, list[tuple[str, str]]]:
    return response.status_code, [(d["field"], d["msg"]) for d in response.json()["detail"]]


def spec_of(root: Path, **overrides) -> dict:
    """tiny_spec training on the corpus under a user's data root `root`."""
    data = {"path": str(root / "corpus.txt"), **overrides.pop("data", {})}
    return tiny_spec(data=data, **overrides)


def with_path(root: Path, field: str, path: str) -> dict:
    """spec_of(root) with `field` (dotted; `data.sources` takes one source) naming `path`."""
    section, _, key = field.partition(".")
    if field == "data.sources":
        return spec_of(root, data={"kind": "tokens", "path": None, "sources": [{"path": path}]})
    if section == "init_from":  # the adapter is checked before the model it adapts
        return spec_of(root, init_from={"hf": path} if key == "hf" else {"hf": path, "adapter": path})
    return spec_of(root, **{section: {key: path}})


FIELDS = ["data.path", "data.val_path", "data.sources", "init_from.hf", "init_from.adapter"]


@pytest.mark.parametrize("field", FIELDS)
def test_every_path_field_reads_only_the_users_own_areas_with_one_answer(yard, field):
    svc, roots, _, http, _ = yard
    state = svc.state_dir
    outside = {
        "another user's root": str(roots["bob"] / "corpus.txt"),
        "the admin's token": str(state / "token"),
        "the store": str(state / "jobs.db"),
        "the state directory": str(state),
        "..": str(roots["alice"] / ".." / "bob-data" / "corpus.txt"),
        "~": "~/" + os.path.relpath(state / "token", Path.home()),
        "a symlink to the token": str(roots["alice"] / "to-token"),
        "a directory with a link out": str(roots["alice"] / "linked-dir"),
        "a symlink to another root": str(roots["alice"] / "to-bob" / "corpus.txt"),
        "a system file": "/etc/hostname",
    }
    mine = roots["alice"]
    missing = refusal(http["alice"].post("/api/plans", json=with_path(mine, field, str(roots["bob"] / "nowhere"))))
    wanted_field = "data.sources.0.path" if field == "data.sources" else field
    assert missing[0] == 422 and missing[1][0][0] == wanted_field, missing
    for what, path in outside.items():
        for route in ("/api/plans", "/api/jobs"):
            answer = refusal(http["alice"].post(route, json=with_path(mine, field, path)))
            assert answer == missing, (what, route, answer)  # the same code and text as a missing path's
    assert "holds" not in missing[1][0][1] and "bytes" not in missing[1][0][1]


def test_a_checkpoint_directory_lies_under_the_users_roots(yard):
    svc, roots, _, http, _ = yard
    for path in (str(svc.state_dir / "checkpoints"), "/tmp/anywhere", str(roots["bob"] / "ck"),
                 str(roots["alice"] / ".." / "bob-data" / "ck")):
        answer = http["alice"].post("/api/plans", json=spec_of(roots["alice"], checkpoint={"path": path}))
        assert answer.status_code == 422 and answer.json()["detail"][0]["field"] == "checkpoint.path", path
    ckpt = {"path": str(roots["alice"] / "ck")}
    mine = http["alice"].post("/api/plans", json=spec_of(roots["alice"], checkpoint=ckpt))
    assert mine.status_code == 200, mine.text


def test_the_admin_reads_any_path_but_the_state_directory(yard):
    svc, roots, _, _, _ = yard
    admin = httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {svc.token}"}, timeout=60)
    assert admin.post("/api/plans", json=tiny_spec(data={"path": str(roots["bob"] / "corpus.txt")})).status_code == 200
    refused = admin.post("/api/plans", json=tiny_spec(data={"path": str(svc.state_dir / "token")}))
    assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == "data.path"
    admin.close()


def test_another_users_job_answers_as_a_missing_one_everywhere(yard):
    _, roots, _, http, alices = yard
    bob = http["bob"]

    def answer(method: str, path: str, **kwargs) -> tuple[int, str]:
        response = bob.request(method, path, **kwargs)
        return response.status_code, response.text

    routes = [("GET", "/api/jobs/{}"), ("GET", "/api/jobs/{}/metrics"), ("GET", "/api/jobs/{}/logs"),
              ("GET", "/api/jobs/{}/events"), ("GET", "/api/jobs/{}/model"), ("GET", "/api/jobs/{}/tracking"),
              ("POST", "/api/jobs/{}/stop"), ("DELETE", "/api/jobs/{}")]
    for method, route in routes:
        theirs, missing = answer(method, route.format(alices)), answer(method, route.format(MISSING_JOB))
        assert theirs[0] == missing[0] == 404 and theirs[1].replace(alices, "X") == missing[1].replace(MISSING_JOB, "X")
    for route, body in (("/api/jobs/{}/scale", {"dp": 2}), ("/api/jobs/{}/faults", {"kind": "kill", "rank": 0})):
        theirs, missing = answer("POST", route.format(alices), json=body), answer("POST", route.format(MISSING_JOB),
                                                                                 json=body)
        assert theirs[0] == missing[0] == 404 and theirs[1].replace(alices, "X") == missing[1].replace(MISSING_JOB, "X")
    for field, spec in (("resume_from", lambda j: spec_of(roots["bob"], resume_from={"job_id": j})),
                        ("init_from", lambda j: spec_of(roots["bob"], init_from={"job_id": j}))):
        theirs, missing = answer("POST", "/api/jobs", json=spec(alices)), answer("POST", "/api/jobs",
                                                                                json=spec(MISSING_JOB))
        assert theirs[0] == missing[0] == 422 and json.loads(theirs[1])["detail"][0]["field"] == f"{field}.job_id"
        assert theirs[1].replace(alices, "X") == missing[1].replace(MISSING_JOB, "X"), field
        assert "model" not in json.loads(theirs[1])["detail"][0]["msg"]  # none of the job's settings echoed
    assert http["alice"].get(f"/api/jobs/{alices}").json()["status"] == "PENDING"  # bob's stop and delete did nothing


def test_priority_queue_elastic_growth_and_cpu_requests_hold_to_the_users_limits(yard):
    svc, roots, _, http, _ = yard
    carol, mine = http["carol"], roots["carol"]
    spec = spec_of(mine)
    refused = carol.post("/api/jobs", json={**spec, "priority": 1})
    assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == "priority"
    # 16 ranks asking for 0.0001 CPUs each count one CPU each: more than all of carol's 2.
    tiny = carol.post("/api/jobs", json=spec_of(mine, global_batch=16, parallel={"dp": 16},
                                                resources={"cpus_per_worker": 0.0001}))
    assert tiny.status_code == 422 and "needs 16 cpus" in tiny.text, tiny.text
    # An elastic job grows only as far as her quota holds: dp.max lowered to 2, with an event saying so.
    elastic = carol.post("/api/jobs", json=spec_of(mine, parallel={"dp": {"min": 1, "max": 8}, "microbatches": 8}))
    assert elastic.status_code == 201, elastic.text
    elastic_id = elastic.json()["job_id"]
    assert carol.get(f"/api/jobs/{elastic_id}").json()["spec"]["parallel"]["dp"] == {"min": 1, "max": 2}
    events = carol.get(f"/api/jobs/{elastic_id}/events").json()
    assert [e["dp_max"] for e in events if e["kind"] == "elastic_within_quota"] == [2]
    # A quota that holds exactly the minimum: the job stays at that size, not refused.
    at_min = carol.post("/api/jobs", json=spec_of(mine, parallel={"dp": {"min": 2, "max": 8}, "microbatches": 4}))
    assert at_min.status_code == 201, at_min.text
    assert carol.get(f"/api/jobs/{at_min.json()['job_id']}").json()["spec"]["parallel"]["dp"] == {"min": 2, "max": 2}
    # Her own queue holds two jobs: the next is a 429 while alice still submits.
    over = carol.post("/api/jobs", json=spec)
    assert over.status_code == 429 and "carol" in over.text
    assert http["alice"].post("/api/jobs", json=spec_of(roots["alice"])).status_code == 201
    assert svc.manager.store.queued_count("carol") == 2


def test_trackers_are_the_operators(yard):
    _, roots, _, http, _ = yard
    for tracking, field in (({"mlflow": {"uri": "http://elsewhere:5000"}}, "tracking.mlflow.uri"),
                            ({"wandb": {"project": "theirs"}}, "tracking.wandb.project"),
                            ({"wandb": {"entity": "someone"}}, "tracking.wandb.entity")):
        answer = http["carol"].post("/api/plans", json=spec_of(roots["carol"], tracking=tracking))
        assert answer.status_code == 422 and answer.json()["detail"][0]["field"] == field, answer.text


def raw_request(url: str, head: str) -> bytes:
    """Send a request's head alone (its body never follows) and read the answer: it comes only if the service
    answers without reading the body (else the socket times out and the test fails)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head.encode())
        return s.recv(65536)


def test_nothing_is_read_before_the_token_and_a_large_body_is_refused_unread(yard):
    svc, _, tokens, _, _ = yard
    head = ("POST /api/jobs HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            "content-length: 268435456\r\n{auth}\r\n")
    assert raw_request(svc.url, head.format(auth="")).startswith(b"HTTP/1.1 401")
    assert raw_request(svc.url, head.format(auth="Authorization: Bearer wrong\r\n")).startswith(b"HTTP/1.1 401")
    with_token = head.format(auth=f"Authorization: Bearer {tokens['alice']}\r\n")
    assert raw_request(svc.url, with_token).startswith(b"HTTP/1.1 413")

    def chunks():  # no content-length: read in chunks, refused once past 1 MiB
        for _ in range(64):
            yield b" " * 65536

    answer = httpx.post(f"{svc.url}/api/plans", content=chunks(), timeout=60,
                        headers={"Authorization": f"Bearer {tokens['alice']}", "content-type": "application/json"})
    assert answer.status_code == 413


def test_uploads_are_their_owners_and_count_against_the_storage_quota(yard, tmp_path):
    svc, roots, tokens, http, _ = yard
    users.update(svc.state_dir, "bob", users.Limits(max_storage_bytes=CORPUS.stat().st_size * 3 // 2))
    alice, bob = Client(svc.url, tokens["alice"]), Client(svc.url, tokens["bob"])
    try:
        mine = alice.upload(CORPUS)
        assert mine["bytes"] == CORPUS.stat().st_size and Path(mine["path"]).read_bytes() == CORPUS.read_bytes()
        folder = tmp_path / "prepared"
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "a.txt").write_text("a")
        directory = alice.upload(folder)
        assert directory["kind"] == "directory" and (Path(directory["path"]) / "sub" / "a.txt").read_text() == "a"
        assert {u["upload_id"] for u in alice.uploads()} == {mine["upload_id"], directory["upload_id"]}
        assert bob.uploads() == []
        with pytest.raises(ApiError) as info:
            bob.delete_upload(mine["upload_id"])
        assert info.value.status_code == 404
        theirs = http["bob"].post("/api/plans", json=spec_of(roots["bob"], data={"path": mine["path"]}))
        assert theirs.status_code == 422 and theirs.json()["detail"][0]["field"] == "data.path"
        own = http["alice"].post("/api/plans", json=spec_of(roots["alice"], data={"path": mine["path"]}))
        assert own.status_code == 200, own.text
        # A tar holding a link is refused, and nothing of it kept.
        evil = tmp_path / "evil.tar"
        with tarfile.open(evil, "w") as tar:
            info_link = tarfile.TarInfo("link")
            info_link.type, info_link.linkname = tarfile.SYMTYPE, str(svc.state_dir / "token")
            tar.addfile(info_link)
        refused = http["alice"].post("/api/files", params={"name": "evil", "archive": "tar"},
                                     content=evil.read_bytes())
        assert refused.status_code == 422 and len(alice.uploads()) == 2
        # bob's quota: one corpus fits, a second does not (413, nothing kept); deleting the first frees it.
        first = bob.upload(CORPUS)
        with pytest.raises(ApiError) as info:
            bob.upload(CORPUS)
        assert info.value.status_code == 413 and [u["upload_id"] for u in bob.uploads()] == [first["upload_id"]]
        bob.delete_upload(first["upload_id"])
        assert bob.upload(CORPUS)["bytes"] == CORPUS.stat().st_size
    finally:
        alice.close()
        bob.close()


def test_ordinary_use_works_within_the_roots_and_uploads(ray_session, tmp_path):
    """Jobs run: one on an uploaded file, one on a file under a data root; both SUCCEED and their models
    download; a job then starts from one of them (`init_from.job_id`), which another user cannot name; a deleted
    job's checkpoints and model go with it."""
    root = tmp_path / "data"
    root.mkdir()
    shutil.copy(CORPUS, root / "corpus.txt")
    svc = start_service(tmp_path / "state")
    token = users.create(svc.state_dir, "dana", limits=users.Limits(data_roots=(str(root),)))
    other = users.create(svc.state_dir, "erin")
    dana = Client(svc.url, token)
    try:
        uploaded = dana.upload(CORPUS)["path"]
        jobs = [dana.submit(tiny_spec(name=name, data={"path": path}))
                for name, path in (("uploaded", uploaded), ("rooted", str(root / "corpus.txt")))]
        for job_id in jobs:
            job = wait_terminal(dana, job_id)
            assert job["status"] == "SUCCEEDED", job["error"]
            assert dana.download_model(job_id, tmp_path / f"{job_id}.safetensors").stat().st_size > 0
        started = dana.plan(tiny_spec(init_from={"job_id": jobs[0]}, data={"path": uploaded}))
        assert started["world_size"] == 1
        with pytest.raises(ApiError) as info:
            Client(svc.url, other).plan(tiny_spec(init_from={"job_id": jobs[0]}, data={"kind": "synthetic",
                                                                                       "path": None}))
        assert info.value.status_code == 422 and f"no job {jobs[0]}" in str(info.value)
        files = [svc.manager.paths.model_path(jobs[1]).parent, svc.state_dir / "checkpoints" / jobs[1]]
        assert all(f.exists() for f in files)
        dana.delete(jobs[1])
        assert not any(f.exists() for f in files)
    finally:
        dana.close()
        svc.shutdown()
