"""Where the Tinker API's saved state lives and who may name it (`service.tenancy.tinker_paths`), pure: a `tinker://`
path is the SDK's own form (its parser agrees), a run id, name or path that cannot be one is refused naming the field
and never quoting it, and a path resolves in its caller's folder only: another user's checkpoint answers as missing,
exactly as one that never was; what the state lists parses as the SDK's own response models."""

from __future__ import annotations

import pytest
from trainyard.parallel.config import RuleError
from trainyard.parallel.io import checkpoint
from trainyard.service.errors import CheckpointNotFound
from trainyard.service.tenancy.tinker_paths import TinkerPaths, parse, ref_of


def test_a_path_is_the_sdks_form_and_bad_ones_are_refused_naming_the_field():
    ref = parse("tinker://session-ab12:train:0/weights/step-0010")
    assert (ref.run_id, ref.kind, ref.name, ref.checkpoint_id) == ("session-ab12:train:0", "weights", "step-0010",
                                                                  "weights/step-0010")
    assert ref.tinker_path == "tinker://session-ab12:train:0/weights/step-0010"
    tinker = pytest.importorskip("tinker")
    theirs = tinker.types.ParsedCheckpointTinkerPath.from_tinker_path(ref.tinker_path)
    assert (theirs.training_run_id, theirs.checkpoint_id, theirs.checkpoint_type) == (
        ref.run_id, ref.checkpoint_id, ref.checkpoint_type)

    for bad in ("tinker://secret/../weights", "tinker://secret/weights/../x", "tinker://secret/weights/.hidden",
                "tinker://secret/sampler_weights/x", "tinker://sec ret/weights/x", "file:///secret/weights/x",
                "tinker://secret/weights/x/y", "tinker://secret/weights/", ""):
        with pytest.raises(RuleError) as e:
            parse(bad, "path")
        assert e.value.field == "path" and "secret" not in e.value.message
    with pytest.raises(RuleError) as e:
        ref_of("secret run", "weights/x")
    assert e.value.field == "checkpoint_id" and "secret" not in e.value.message


def test_a_path_resolves_in_its_callers_folder_only(tmp_path):
    paths = TinkerPaths(tmp_path / "tinker")
    ref = parse("tinker://model-1/weights/two")
    directory = paths.checkpoint_dir("alice", ref)
    assert directory == tmp_path / "tinker" / "alice" / "model-1" / "weights" / "two"
    with pytest.raises(CheckpointNotFound) as e:
        paths.existing("alice", ref)  # nothing saved yet
    assert e.value.args == ("path",)
    checkpoint.step_dir(directory, 2).mkdir(parents=True)  # a committed checkpoint (its files aside)
    checkpoint.step_dir(paths.checkpoint_dir("alice", parse("tinker://model-1/weights/half")), 3).with_name(
        "step_000000003.tmp").mkdir(parents=True)  # a save under way: not a checkpoint yet
    (paths.run_dir("alice", "model-1") / "run.json").write_text("{}")
    assert paths.existing("alice", ref) == directory
    assert [r.name for r in paths.checkpoints("alice", "model-1")] == ["two"]
    assert paths.runs("alice") == ["model-1"]
    with pytest.raises(CheckpointNotFound) as e:
        paths.existing("bob", ref, "tinker_path")
    assert e.value.args == ("tinker_path",)
    with pytest.raises(CheckpointNotFound):
        paths.existing_run("bob", "model-1")
    assert paths.runs("bob") == [] and paths.checkpoints("bob", "model-1") == []


def test_listings_are_the_sdks_shapes_and_a_checkpoint_past_its_ttl_is_gone(tmp_path):
    """What `service.tinker.state` lists parses as the SDK's own response models; a checkpoint whose TTL passed is
    deleted when next looked at."""
    import json
    import time
    from types import SimpleNamespace

    from trainyard.service.tenancy.users import User
    from trainyard.service.tinker.clients import TinkerClients

    tinker = pytest.importorskip("tinker")
    paths = TinkerPaths(tmp_path / "tinker")
    clients = TinkerClients(tenancy=SimpleNamespace(tinker=paths))  # type: ignore[arg-type]
    alice = User("alice", admin=False)
    now = time.time()
    for name, made in (("kept", {"time": now - 10, "expires_at": None, "user_metadata": {"k": "v"}}),
                       ("expired", {"time": now - 20, "expires_at": now - 1, "user_metadata": None})):
        step = checkpoint.step_dir(paths.checkpoint_dir("alice", parse(f"tinker://model-1/weights/{name}")), 4)
        step.mkdir(parents=True)
        (step / checkpoint.MANIFEST).write_text(json.dumps({"files": {}, "tinker": {
            **made, "base_model": "tiny", "lora_rank": 4, "seed": 0, "targets": None}}))
    (paths.run_dir("alice", "model-1") / "run.json").write_text(json.dumps(
        {"training_run_id": "model-1", "created": now - 30, "base_model": "tiny", "lora_rank": 4}))

    listed = tinker.types.CheckpointsListResponse.model_validate(clients.state.checkpoints(alice, "model-1"))
    assert [(c.checkpoint_id, c.tinker_path, c.user_metadata) for c in listed.checkpoints] == [
        ("weights/kept", "tinker://model-1/weights/kept", {"k": "v"})]
    assert not paths.checkpoint_dir("alice", parse("tinker://model-1/weights/expired")).exists()
    runs = tinker.types.TrainingRunsResponse.model_validate(clients.state.runs(alice, limit=10, offset=0))
    assert [(r.training_run_id, r.lora_rank, r.last_checkpoint.checkpoint_id) for r in runs.training_runs] == [
        ("model-1", 4, "weights/kept")]
    mine = tinker.types.CheckpointsListResponse.model_validate(clients.state.user_checkpoints(alice, 10, 0))
    assert [c.checkpoint_id for c in mine.checkpoints] == ["weights/kept"] and mine.cursor.total_count == 1
    with pytest.raises(CheckpointNotFound):
        clients.state.checkpoints(User("bob", admin=False), "model-1")
