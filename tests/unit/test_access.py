"""The tenancy rules, pure or on files alone (no Ray, no HTTP): which paths a user's job may read and write
(`service.tenancy.access`), the names a manifest or an index may give (`token_dir`, `hf_spec`), a quota's charge and the
elastic cap (`service.tenancy.quota`), the operator's trackers (`service.tenancy.trackers`) and an upload's tar
(`service.tenancy.uploads`)."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from pathlib import Path

import pytest
from helpers import tiny_spec
from trainyard.parallel.config import RuleError
from trainyard.parallel.data.token_dir import Manifest
from trainyard.parallel.spec import parse_spec
from trainyard.service.tenancy.access import NOT_READABLE, Access, Owner
from trainyard.service.tenancy.quota import Quota, replicas_within
from trainyard.service.tenancy.trackers import TrackerPolicy
from trainyard.service.tenancy.uploads import Uploads, UploadTooLarge


@pytest.fixture()
def areas(tmp_path: Path):
    state, root, other = tmp_path / "state", tmp_path / "root", tmp_path / "other"
    for d in (state, root, other, state / "uploads" / "ann", state / "models" / "job1"):
        d.mkdir(parents=True)
    for f in (state / "token", root / "data.bin", other / "data.bin", state / "uploads" / "ann" / "up.bin",
              state / "models" / "job1" / "model.safetensors"):
        f.write_bytes(b"x")
    access = Access(state, owns=lambda job, user: (job, user) == ("job1", "ann"))
    return access, Owner("ann", data_roots=(str(root),)), state, root, other


def refused(access: Access, owner: Owner, path: str) -> str:
    with pytest.raises(RuleError) as info:
        access.readable(owner, "data.path", path)
    return info.value.message


def test_a_user_reads_their_roots_uploads_and_jobs_outputs_and_nothing_else_with_one_answer(areas):
    access, ann, state, root, other = areas
    for ok in (root / "data.bin", root, state / "uploads" / "ann" / "up.bin", state / "models" / "job1"):
        assert access.readable(ann, "data.path", str(ok)) == str(ok.resolve())
    (root / "up").symlink_to(state / "token")
    (root / "loop").symlink_to(root)  # a link back into the root: walked once, not forever
    (root / "sub").mkdir()
    (root / "sub" / "link").symlink_to(other / "data.bin")
    (root / "via").symlink_to(root / "sub")  # a linked directory holding a link out
    answers = {refused(access, ann, str(p)) for p in (
        other / "data.bin", state / "token", state, state / "models", root / "up", root / "sub", root / "via",
        root / ".." / "other" / "data.bin", root / "missing", state / "uploads" / "bob", "/nonexistent/\x00x")}
    assert answers == {NOT_READABLE}
    assert refused(access, ann, str(root)) == NOT_READABLE  # the root itself now holds links out


def test_an_admin_reads_anything_but_the_state_directory_and_checkpoints_go_under_the_roots(areas):
    access, ann, state, root, other = areas
    admin = Owner("admin", admin=True)
    assert access.readable(admin, "data.path", str(other / "data.bin"))
    assert refused(access, admin, str(state / "token")) == NOT_READABLE
    assert access.writable(ann, "checkpoint.path", str(root / "new" / "ck")) == str(root / "new" / "ck")
    for owner, path in ((ann, other), (ann, state / "x"), (admin, state / "checkpoints"), (admin, state.parent)):
        with pytest.raises(RuleError, match="checkpoint"):
            access.writable(owner, "checkpoint.path", str(path))
    assert access.writable(admin, "checkpoint.path", str(other)) == str(other)


def test_confine_resolves_every_path_field_and_leaves_wrong_types_to_validation(areas):
    access, ann, _, root, _ = areas
    spec = {"data": {"path": f"{root}/./data.bin", "sources": [{"path": str(root / "data.bin")}, 3]},
            "checkpoint": {"path": str(root / "ck")}, "init_from": {"hf": 5}}
    out = access.confine(ann, spec)
    assert out["data"]["path"] == str(root / "data.bin") and out["data"]["sources"][1] == 3
    assert out["init_from"] == {"hf": 5} and spec["data"]["path"].endswith("/./data.bin")  # a copy changed
    with pytest.raises(RuleError) as info:
        access.confine(ann, {"data": {"sources": [{"path": str(root / "data.bin")}, {"path": "/etc"}]}})
    assert info.value.field == "data.sources.1.path"


def test_a_manifest_or_index_naming_a_file_outside_its_directory_is_refused(tmp_path):
    from trainyard.parallel.io.hf_spec import _check_index

    shard = {"file": "../../state/token", "tokens": 1}
    manifest = Manifest(dtype="uint16", vocab_size=2, eos_id=0, documents=1, tokens=1, counted_tokens=None,
                        tokenizer={"sha256": ""}, shards=[shard], fingerprint="", inputs=[], options={})
    assert "outside the directory" in manifest._malformed()
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "/etc/passwd"}}))
    with pytest.raises(RuleError, match="outside the directory"):
        _check_index(index)


def test_a_rank_counts_at_least_one_cpu_and_an_elastic_job_at_most_what_the_quota_holds():
    from trainyard.parallel.plan import make_plan
    from trainyard.service.tenancy.quota import charge

    plan = make_plan(parse_spec(tiny_spec(global_batch=16, parallel={"dp": 16},
                                          resources={"cpus_per_worker": 0.0001, "gpus_per_worker": 0})))
    assert charge(plan) == {"CPU": 16.0, "GPU": 0.0} and charge(plan, at_dp=2)["CPU"] == 2.0
    assert replicas_within(Quota(cpus=5), charge(plan, at_dp=1)) == 5
    assert replicas_within(Quota(), charge(plan, at_dp=1)) is None


def test_trackers_are_the_operators_for_users_and_an_admins_choice_for_admins():
    policy = TrackerPolicy(mlflow_uri="http://mlflow.internal:5000", wandb_project="team")
    config = parse_spec(tiny_spec(tracking={"mlflow": {}, "wandb": {}}))
    given = policy.apply(config, admin=False).tracking
    assert given.mlflow.uri == "http://mlflow.internal:5000" and given.wandb.project == "team"
    for tracking, field in (({"mlflow": {"uri": "file:///elsewhere"}}, "tracking.mlflow.uri"),
                            ({"wandb": {"project": "mine"}}, "tracking.wandb.project")):
        with pytest.raises(RuleError) as info:
            policy.apply(parse_spec(tiny_spec(tracking=tracking)), admin=False)
        assert info.value.field == field
    own = policy.apply(parse_spec(tiny_spec(tracking={"wandb": {"project": "mine"}})), admin=True)
    assert own.tracking.wandb.project == "mine"


def _tar(members: list[tarfile.TarInfo], data: bytes = b"") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for member in members:
            tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return buffer.getvalue()


async def _chunks(data: bytes):
    for i in range(0, len(data), 7):
        yield data[i:i + 7]


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a/../../b"])
def test_an_uploaded_tar_with_a_name_out_of_it_is_refused_and_nothing_kept(tmp_path, name):
    member = tarfile.TarInfo(name)
    member.size = 1
    uploads = Uploads(tmp_path / "uploads")
    with pytest.raises(RuleError, match="plain files and folders"):
        asyncio.run(uploads.receive("ann", "ds", _chunks(_tar([member], b"x")), 100_000, archive=True))
    assert list((tmp_path / "uploads" / "ann").iterdir()) == [] and uploads.list("ann") == []


def test_an_upload_past_its_limit_keeps_nothing(tmp_path):
    uploads = Uploads(tmp_path / "uploads")
    with pytest.raises(UploadTooLarge):
        asyncio.run(uploads.receive("ann", "f.bin", _chunks(b"x" * 100), 99))
    done = asyncio.run(uploads.receive("ann", "f.bin", _chunks(b"x" * 100), 100))
    assert [u.upload_id for u in uploads.list("ann")] == [done.upload_id] and Path(done.path).stat().st_size == 100
    (tmp_path / "uploads" / "ann" / ".0123456789ab.tmp").mkdir()  # what a killed service's upload left
    uploads.sweep_partial()
    assert [p.name for p in (tmp_path / "uploads" / "ann").iterdir()] == [done.upload_id]


def test_an_upload_larger_than_a_json_body_streams_in_and_past_its_limit_keeps_nothing(tmp_path):
    """The upload route's own limit, not the 1 MiB of a JSON body (a TestClient over a manager without Ray)."""
    from fastapi.testclient import TestClient
    from trainyard.api.app import create_app
    from trainyard.service.manager import JobManager
    from trainyard.service.store import JobStore

    manager = JobManager(JobStore(tmp_path / "jobs.db"), admit=False)
    client = TestClient(create_app(manager, "t", max_upload_bytes=5 << 20))
    auth = {"Authorization": "Bearer t"}
    try:
        kept = client.post("/api/files", params={"name": "big.bin"}, content=b"x" * (3 << 20), headers=auth)
        assert kept.status_code == 201 and kept.json()["bytes"] == 3 << 20
        too_big = client.post("/api/files", params={"name": "bigger.bin"}, content=b"x" * (6 << 20), headers=auth)
        assert too_big.status_code == 413
        assert [u["name"] for u in client.get("/api/files", headers=auth).json()] == ["big.bin"]
        spec = client.post("/api/plans", content=b" " * (2 << 20), headers={**auth, "content-type": "application/json"})
        assert spec.status_code == 413
    finally:
        manager.shutdown()
