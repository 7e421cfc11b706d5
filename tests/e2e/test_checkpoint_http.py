"""What a job leaves behind, through the real service (uvicorn, Ray, gloo): sharded checkpoints written in the
background, resuming at the same layout bit-identically, the trained model as one safetensors file that loads
into `full_model` and reproduces the job's final validation loss, and the rules a resume must follow; `make
test-slow` adds a full disk that fails checkpoints, not the job (a save to a full file system:
tests/unit/test_checkpoint.py). (Resuming at another layout, dense and MoE, on the same loss curve:
tests/integration/test_checkpoint_gloo.py.)"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import run_all, slow, tiny_spec
from safetensors import safe_open
from safetensors.torch import load_file
from trainyard.parallel.data.datasets import load_batch, open_dataset
from trainyard.parallel.data.sampler import validation_batches
from trainyard.parallel.io.export import MODEL_FILE
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.spec import parse_spec

STEPS = 6


def spec(parallel: dict, **top) -> dict:
    return tiny_spec(model={"n_layer": 4}, global_batch=8, steps=STEPS, parallel=parallel,
                     eval={"every": 3, "batches": 2}, **top)


@pytest.fixture(scope="module")
def originals(service) -> dict[str, tuple[dict, list[dict]]]:
    client = service.client()
    out = run_all(client, {"dense": spec({"tp": 2}, checkpoint={"every": 3, "async": True})})
    client.close()
    return out


@pytest.fixture(scope="module")
def resumed(service, originals) -> dict[str, tuple[dict, list[dict]]]:
    client = service.client()
    dense = originals["dense"][0]["job_id"]
    out = run_all(client, {"dense-same": spec({"tp": 2}, resume_from={"job_id": dense, "step": 3})})
    client.close()
    return out


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def test_checkpoints_are_written_every_n_steps_and_at_the_end(originals, service):
    job, rows = originals["dense"]
    root = service.manager.paths.checkpoint_root(job["job_id"], parse_spec(job["spec"]))
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_000000003", "step_000000006"]
    assert [r["step"] for r in rows if r["checkpoint_blocked_s"] is not None] == [2]  # the final save is no step's
    assert all(r.get("val_loss") is not None for r in rows if r["step"] in (2, 5))


def test_a_job_resumed_at_its_own_layout_is_bit_identical(originals, resumed):
    assert losses(resumed["dense-same"][1]) == losses(originals["dense"][1])[3:]
    assert [r["val_loss"] for r in resumed["dense-same"][1] if r["val_loss"] is not None] == \
        [r["val_loss"] for r in originals["dense"][1][3:] if r["val_loss"] is not None]


def test_the_exported_model_loads_into_full_model_and_gives_the_final_val_loss(originals, client, tmp_path):
    job, rows = originals["dense"]
    path = client.download_model(job["job_id"], tmp_path / MODEL_FILE)
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    config = parse_spec(job["spec"])
    assert metadata["step"] == str(STEPS)
    model = full_model(config.model, seed=12345)  # another seed: every weight must come from the file
    model.load_state_dict(load_file(str(path)), strict=True)
    val = open_dataset(config, "val")
    with torch.no_grad():
        total = 0.0
        for ids in validation_batches(config, val.num_samples):
            inputs, targets = load_batch(val, ids)
            total += float(model.loss_sum(model(inputs), targets)) / targets.numel()
    assert total / config.eval.batches == pytest.approx(rows[-1]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("resume,field,text", [
    ({"job_id": "nosuchjob"}, "resume_from.job_id", "no job nosuchjob"),
    ({"job_id": "@dense", "step": 4}, "resume_from.step", "no intact checkpoint of step 4"),
    ({"job_id": "@dense"}, "steps", "nothing left to train"),
])
def test_resume_rules_are_422_naming_the_field(originals, client, resume, field, text):
    resume = {**resume, "job_id": originals["dense"][0]["job_id"] if resume["job_id"] == "@dense"
              else resume["job_id"]}
    response = client._http.post("/api/jobs", json=spec({"tp": 2}, resume_from=resume))
    assert response.status_code == 422
    assert any(d["field"] == field and text in d["msg"] for d in response.json()["detail"]), response.json()


def test_a_different_model_cannot_resume(originals, client):
    other = spec({}, resume_from={"job_id": originals["dense"][0]["job_id"], "step": 3})
    other["model"] = {**other["model"], "d_model": 64}
    response = client._http.post("/api/jobs", json=other)
    assert response.status_code == 422
    assert "model.d_model: 32 there, 64 here" in response.json()["detail"][0]["msg"]


def test_deleting_a_job_removes_its_model_and_checkpoints(service, originals, resumed, client):
    job = originals["dense"][0]
    root = service.manager.paths.checkpoint_root(job["job_id"], parse_spec(job["spec"]))
    model = service.manager.paths.model_path(job["job_id"])
    assert root.is_dir() and model.is_file()
    client.delete(job["job_id"])
    assert not root.exists() and not model.exists()


@slow
def test_a_full_disk_fails_checkpoints_not_the_job_which_succeeds_once_space_returns(service, tmp_path):
    """The checkpoints go to a small file system that is full: each failed write is an event, the job trains on
    (the checkpoints before stay), and once space returns the next one is written and the job SUCCEEDS."""
    import subprocess

    from helpers import small_file_system, wait_for, wait_terminal

    with small_file_system(tmp_path / "disk", "4m") as disk, contextlib.closing(service.client()) as client:
        filler = disk / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)  # until the disk is full
        # 120 steps (about six seconds here): the job must outlast the test's freeing the disk after the first
        # failure (under a second), or no checkpoint after it would show that the writes came back
        job_id = client.submit(tiny_spec(name="full-disk", steps=120, parallel={"dp": 2},
                                         checkpoint={"every": 2, "path": str(disk), "max_write_failures": 100}))
        wait_for(lambda: any(e["kind"] == "checkpoint_failed" for e in client.events(job_id))
                 or client.job(job_id)["status"] in ("FAILED", "SUCCEEDED"), 120, "a checkpoint to fail")
        assert client.job(job_id)["status"] == "RUNNING", (client.job(job_id)["error"], client.events(job_id))
        filler.unlink()
        job = wait_terminal(client, job_id)
        assert job["status"] == "SUCCEEDED", job
        events = client.events(job_id)
        failed = [e for e in events if e["kind"] == "checkpoint_failed"]
        assert failed[0]["in_a_row"] == 1 and "No space left on device" in failed[0]["error"], failed
        assert any(e["kind"] == "checkpoint" and e["step"] > failed[-1]["step"] for e in events), \
            [(e["kind"], e.get("step")) for e in events]
