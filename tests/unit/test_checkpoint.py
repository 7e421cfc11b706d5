"""Checkpoint directories: a checkpoint is visible only once committed, a damaged or half-written one is
found and the one before it used, and only the newest `keep` stay. Real DCP files, written by one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from trainyard.parallel.io import checkpoint


def write(root: Path, step: int) -> Path:
    """A committed checkpoint of step `step` holding one tensor filled with the step."""
    tmp = checkpoint.step_dir(root, step).with_name(checkpoint.step_dir(root, step).name + ".tmp")
    tmp.mkdir(parents=True)
    dcp.save({"w": torch.full((64,), float(step))}, checkpoint_id=tmp, no_dist=True)
    checkpoint.commit(tmp, checkpoint.step_dir(root, step), {"step": step})
    return checkpoint.step_dir(root, step)


def read(directory: Path) -> float:
    state = {"w": torch.zeros(64)}
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    return float(state["w"][0])


def test_the_latest_intact_checkpoint_is_found_and_loads(tmp_path):
    for step in (2, 4):
        write(tmp_path, step)
    found = checkpoint.latest_valid(tmp_path)
    assert (found.step, found.skipped) == (4, ())
    assert read(found.directory) == 4.0
    assert checkpoint.read_manifest(found.directory)["step"] == 4


def test_a_half_written_checkpoint_is_not_visible(tmp_path):
    write(tmp_path, 2)
    half = checkpoint.step_dir(tmp_path, 4).with_name("step_000000004.tmp")  # a save cut off before its commit
    half.mkdir()
    dcp.save({"w": torch.full((64,), 4.0)}, checkpoint_id=half, no_dist=True)
    assert checkpoint.committed_steps(tmp_path) == [2]
    assert checkpoint.latest_valid(tmp_path).step == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no-manifest", "manifest-a-list",
                                    "files-a-list", "file-not-a-pair"])
def test_a_damaged_checkpoint_is_detected_and_the_previous_one_used(tmp_path, damage):
    write(tmp_path, 2)
    latest = write(tmp_path, 4)
    data = next(p for p in latest.iterdir() if p.suffix == ".distcp")
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-10])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "delete":
        data.unlink()
    elif damage in ("manifest-a-list", "files-a-list", "file-not-a-pair"):  # JSON of another shape
        manifest = latest / checkpoint.MANIFEST
        files = checkpoint.read_manifest(latest)["files"]
        shaped = {"manifest-a-list": [files], "files-a-list": {"files": list(files.items())},
                  "file-not-a-pair": {"files": {name: size for name, (size, _) in files.items()}}}
        manifest.write_text(json.dumps(shaped[damage]))
    else:
        (latest / checkpoint.MANIFEST).unlink()
    assert checkpoint.verify(latest) is not None
    found = checkpoint.latest_valid(tmp_path)
    assert found.step == 2 and found.skipped and found.skipped[0].startswith("step 4:")
    assert read(found.directory) == 2.0


def test_prune_keeps_the_newest_and_clears_stale_temporaries(tmp_path):
    for step in (1, 2, 3, 4):
        write(tmp_path, step)
    stale = tmp_path / "step_000000002.tmp"
    stale.mkdir()
    checkpoint.prune(tmp_path, keep=2, step=4)
    assert checkpoint.committed_steps(tmp_path) == [3, 4]
    assert not stale.exists()


@pytest.mark.parametrize("keep", [1, 2])
def test_prune_keeps_the_checkpoint_just_written_before_a_later_one_a_recovery_passed_over(tmp_path, keep):
    # step 6 is damaged (or ahead of its metrics row): the job went on from step 2 and a stop saved step 3
    for step in (1, 2, 6, 3):
        write(tmp_path, step)
    checkpoint.prune(tmp_path, keep=keep, step=3)
    assert checkpoint.committed_steps(tmp_path) == [2, 3][-keep:]
    assert read(checkpoint.step_dir(tmp_path, 3)) == 3.0


def test_latest_valid_at_most_a_step(tmp_path):
    for step in (3, 6):
        write(tmp_path, step)
    assert checkpoint.latest_valid(tmp_path, at_most=5).step == 3
    assert checkpoint.latest_valid(tmp_path / "none") is None


@pytest.fixture()
def small_file_system(tmp_path):
    """A 2 MiB tmpfs of its own (a full disk that a test can fill and free)."""
    from helpers import small_file_system as mounted

    with mounted(tmp_path / "fs", "2m") as where:
        yield where


def test_a_checkpoint_the_disk_cannot_hold_fails_alone_and_the_next_is_written_once_space_returns(small_file_system):
    root = small_file_system / "ckpt"
    checkpoint.save({"w": torch.full((1024,), 2.0)}, root, 2, {}, None, is_writer=True)
    filler = small_file_system / "filler"
    with filler.open("wb") as f:  # the rest of the disk taken
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    with pytest.raises(checkpoint.CheckpointWriteError, match="checkpoint of step 4 was not written"):
        checkpoint.save({"w": torch.full((65536,), 4.0)}, root, 4, {}, None, is_writer=True)
    assert checkpoint.committed_steps(root) == [2] and checkpoint.verify(checkpoint.step_dir(root, 2)) is None
    filler.unlink()
    checkpoint.save({"w": torch.full((65536,), 6.0)}, root, 6, {}, None, is_writer=True)
    assert checkpoint.latest_valid(root).step == 6


def test_a_checkpoint_root_that_cannot_be_made_is_a_write_error():
    with pytest.raises(checkpoint.CheckpointWriteError, match="NotADirectoryError"):
        checkpoint.save({"w": torch.zeros(4)}, Path(__file__) / "ckpt", 2, {}, None, is_writer=True)
