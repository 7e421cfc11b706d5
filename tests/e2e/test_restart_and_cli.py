"""Jobs that were live when the service died are queued again on start, and the CLI against a real server (`make
test-slow` adds a job queued again by the restart and then stopped, which keeps its trained model). (Jobs and
metrics across restarts of a real `trainyard serve`: test_serve_process.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import start_service
from helpers import REPO, slow, tiny_spec, wait_for
from trainyard.actors.state import JobStatus
from trainyard.cli.client import ApiError
from trainyard.cli.main import main as cli
from trainyard.service.store import JobRecord, JobStore


def test_jobs_live_when_the_service_died_are_queued_again_on_start(ray_session, tmp_path):
    """... and a job that had ended is kept as it was, its metrics rows and events too."""
    store = JobStore(tmp_path / "jobs.db")
    store.insert(JobRecord(job_id="orphan", name="x", status=JobStatus.RUNNING, spec=tiny_spec(), steps=4,
                           needs={"bundle": {"CPU": 1.0}, "count": 1}))
    store.insert(JobRecord(job_id="ended", name="y", status=JobStatus.SUCCEEDED, spec=tiny_spec(), steps=2, step=2,
                           needs={"bundle": {"CPU": 1.0}, "count": 1}, ended_at=1.0,
                           events=[{"time": 1.0, "kind": "checkpoint", "step": 2}]))
    rows = [{"step": i, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 900.0, "step_time_s": 0.1}
            for i, loss in enumerate((5.5, 5.25))]
    store.add_metrics("ended", rows)
    store.close()
    svc = start_service(tmp_path, admit=False)  # keep it queued, to look at it
    try:
        client = svc.client()
        job = client.job("orphan")
        assert job["status"] == "PENDING" and job["queue_position"] == 1 and job["error"] is None
        assert svc.manager.events("orphan")[-1]["kind"] == "interrupted"
        ended = client.job("ended")
        assert (ended["status"], ended["step"], ended["ended_at"], ended["queue_position"]) == ("SUCCEEDED", 2, 1.0,
                                                                                                 None)
        assert [{k: v for k, v in r.items() if v is not None} for r in client.metrics("ended")] == rows
        assert client.events("ended") == [{"time": 1.0, "kind": "checkpoint", "step": 2}]
    finally:
        svc.shutdown()


def test_a_coordinator_the_service_created_but_never_started_is_started_when_the_next_one_reattaches(ray_session,
                                                                                                  tmp_path):
    """The soak found it: a service SIGKILLed between creating a job's (detached) coordinator and starting it left
    the job PENDING for good: the next service reattached to the coordinator, which nobody started. Here the
    coordinator is created as `Admission._admit` creates it, not started, and the store shows the job admitted."""
    import time

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from trainyard.actors.coordinator import Coordinator, JobStorage
    from trainyard.actors.naming import coordinator_name, placement_group_name
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.spec import parse_spec
    from trainyard.service.following.live_jobs import LiveJobs
    from trainyard.service.following.reconcile import reconcile

    spec = tiny_spec(steps=2)
    plan = make_plan(parse_spec(spec))
    pg = placement_group(plan.bundles(), name=placement_group_name("unstarted"), lifetime="detached")
    ray.get(pg.ready(), timeout=60)
    storage = JobStorage(checkpoint_root=str(tmp_path / "ckpt"), model_path=str(tmp_path / "model.safetensors"))
    coordinator = Coordinator.options(name=coordinator_name("unstarted"), lifetime="detached").remote(  # type: ignore[attr-defined]
        "unstarted", plan, pg, storage)
    store = JobStore(tmp_path / "jobs.db")
    store.insert(JobRecord(job_id="unstarted", name="x", status=JobStatus.PENDING, spec=spec, steps=2,
                           needs={"bundle": {"CPU": 1.0}, "count": 1}, admitted_at=time.time()))
    try:
        assert ray.get(coordinator.poll.remote(), timeout=60)["status"] == "PENDING"  # created, never started
        reconcile(LiveJobs(store))
        assert [e["kind"] for e in ray.get(coordinator.poll.remote(), timeout=60)["events"]] == ["reattached"]
        wait_for(lambda: ray.get(coordinator.poll.remote(), timeout=60)["status"] != "PENDING", 60,
                 "the reattached coordinator to start the job")
    finally:
        ray.kill(coordinator, no_restart=True)
        remove_placement_group(pg)
        store.close()


@slow
def test_a_job_the_restart_queued_again_and_then_stopped_keeps_its_trained_model(ray_session, tmp_path):
    """A job that ran 5 of 6 steps (checkpoints at 2 and 4) when the service was killed is queued again; stopped
    before it runs again, it ends as a stop of a running job does: with the model of its latest checkpoint, and
    its step and rows there. It used to end STOPPED at the store's step with no model ("stopped before finishing
    a step")."""
    from helpers import wait_terminal
    from trainyard.parallel.io.export import exported_config

    svc = start_service(tmp_path)
    try:
        job_id = svc.client().submit(tiny_spec(steps=6, checkpoint={"every": 2}))
        assert wait_terminal(svc.client(), job_id)["status"] == "SUCCEEDED"
    finally:
        svc.shutdown()
    # As the killed service left it: running at step 5, the store's rows read up to step 2 only, the last checkpoint
    # and the model not written yet.
    root, model = tmp_path / "checkpoints" / job_id, tmp_path / "models" / job_id / "model.safetensors"
    shutil.rmtree(root / "step_000000006")
    model.unlink()
    store = JobStore(tmp_path / "jobs.db")
    store._db.execute("UPDATE jobs SET status = 'RUNNING', ended_at = NULL, step = 3 WHERE job_id = ?", (job_id,))
    store.drop_metrics_from(job_id, 3)
    store.close()

    svc = start_service(tmp_path, admit=False)  # it stays queued
    try:
        client = svc.client()
        assert client.job(job_id)["status"] == "PENDING"
        stopped = client.stop(job_id)
        assert (stopped["status"], stopped["step"]) == ("STOPPED", 4)
        assert [r["step"] for r in client.metrics(job_id)] == [0, 1, 2, 3]
        assert exported_config(svc.manager.model_file(job_id))[1] == 4
        never_ran = client.submit(tiny_spec())
        assert client.stop(never_ran)["status"] == "STOPPED"
        with pytest.raises(ApiError, match="ended without a model"):
            client.download_model(never_ran, tmp_path / "none.safetensors")
    finally:
        svc.shutdown()


def run_cli(service, *args: str) -> int:
    return cli(["--url", service.url, "--token", service.token, *args])


def test_cli_submits_follows_lists_and_prints_metrics(service, tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(tiny_spec(steps=3, name="from-cli", eval={"every": 2, "batches": 1})))
    assert run_cli(service, "submit", str(spec), "--follow") == 0
    out = capsys.readouterr().out
    job_id = out.splitlines()[0].strip()
    assert f"job {job_id} SUCCEEDED after 3/3 steps; final loss" in out
    assert f"job {job_id} PENDING -> RUNNING at " in out and f"job {job_id} RUNNING -> SUCCEEDED at " in out
    assert run_cli(service, "list") == 0
    assert job_id in capsys.readouterr().out
    assert run_cli(service, "metrics", job_id) == 0
    header, *lines = capsys.readouterr().out.strip().splitlines()
    assert header.split()[:3] == ["step", "loss", "val_loss"] and len(lines) == 3
    # val_loss after the second step and the last; '-' (not nan) on the step without an eval
    assert [line.split()[2] for line in lines][0] == "-"
    assert all(float(line.split()[2]) > 0 for line in lines[1:])
    assert run_cli(service, "metrics", job_id, "--plot", str(tmp_path / "curve.png")) == 0
    assert "loss, tokens/s over steps 0-2" in capsys.readouterr().out
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_shows_api_errors_as_the_api_phrased_them(service, tmp_path, capsys):
    spec = tmp_path / "bad.yaml"
    spec.write_text(json.dumps(tiny_spec(global_batch=6, parallel={"dp": 4})))
    assert run_cli(service, "submit", str(spec)) == 2
    assert "global_batch: global_batch=6 is not divisible by dp x microbatches" in capsys.readouterr().err


def test_cli_plan_works_without_a_server(capsys, tmp_path):
    assert cli(["--url", "http://127.0.0.1:9", "plan", str(REPO / "examples" / "demo.yaml")]) == 0
    assert "pp0-tp0-dp1" in capsys.readouterr().out
    assert cli(["plan", "--json", str(REPO / "examples" / "demo.yaml")]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {n_layer: 2, n_head: 2, d_model: 32}\nsteps: 1\nmystery: 3\n")
    assert cli(["plan", str(bad)]) == 2
    assert "mystery: unknown field 'mystery'" in capsys.readouterr().err


def test_cli_plan_draws_the_schedule_and_takes_simulation_costs(capsys):
    spec = str(REPO / "examples" / "pipeline.yaml")
    assert cli(["plan", spec]) == 0
    out = capsys.readouterr().out
    gantt = [line for line in out.splitlines() if line.startswith("rank ") and "|" in line]
    assert len(gantt) == 4 and all(len(line) == len(gantt[0]) for line in gantt)
    assert "bubble 27.3%, peak activations per stage [4, 3, 2, 1]" in out
    assert cli(["plan", "--json", "--costs", "1,2,0.5", spec]) == 0
    schedule = json.loads(capsys.readouterr().out)["schedule"]
    assert schedule["costs"] == {"forward": 1.0, "backward": 2.0, "comm": 0.5}
    assert schedule["makespan"] > 33


def test_cli_takes_a_token_that_starts_with_a_dash(ray_session, tmp_path, capsys):
    (tmp_path / "token").write_text("-a-token-a-user-brought\n")  # the service never makes one; a user may
    svc = start_service(tmp_path)
    try:
        assert svc.token == "-a-token-a-user-brought"
        assert cli(["--url", svc.url, "--token", svc.token, "list"]) == 0
        assert "job_id" in capsys.readouterr().out
    finally:
        svc.shutdown()
