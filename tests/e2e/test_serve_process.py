"""`trainyard serve` as a real process: SIGTERM stops it in seconds, exit code 0, its live jobs checkpointed
and queued again (with its waiting jobs), and none of its processes (the embedded Ray included) left behind
(checked at the first of the restarts below).
Jobs outlive their service: after SIGTERM or SIGKILL and a new start, a job goes on from its latest
checkpoint (embedded Ray) or is reattached to (a joined cluster), and ends with the losses and weights of a
run that was never interrupted. (That ended jobs and their rows are kept as they were through a restart is
checked in test_restart_and_cli.py, without a job of its own to run.) The SIGTERM and SIGKILL story (34 s)
and the joined cluster's reattach (24 s) run in `make test-slow`; `make test` keeps test_restart_and_cli.py's
requeue and its in-process reattach (a coordinator the service created is started by the next service)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
import torch
from helpers import REPO, slow, tiny_spec, wait_for, wait_terminal
from safetensors.torch import load_file
from trainyard.cli.client import ApiError, Client
from trainyard.cli.demo import stop, wait_ready
from trainyard.parallel.io import checkpoint
from trainyard.parallel.io.export import MODEL_FILE
from trainyard.service.ray_runtime import descendants
from trainyard.service.store import JobStore


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


_services: list[subprocess.Popen] = []
"""Every service `start_serve` started, in order."""


@pytest.fixture(autouse=True)
def _no_service_left_behind():
    """Every service a test of this module started is stopped with the test, also when it failed in the middle
    of a restart, whose newest service the test itself no longer holds (it once left one running, with its
    embedded Ray, after a failure)."""
    first = len(_services)
    yield
    for proc in _services[first:]:
        if proc.poll() is None:
            stop(proc, signal.SIGTERM, 120)


def start_serve(state: Path, log: Path, ray_address: str | None = None, cpus: int = 4
                ) -> tuple[subprocess.Popen, Client]:
    """`trainyard serve` in a subprocess on a free port: an embedded Ray (`cpus` CPUs), or joining `ray_address`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A cluster the test started has Ray's token auth off (tests only); an embedded one keeps the product's: on
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"} if ray_address else \
        {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    where = ["--ray-address", ray_address] if ray_address else ["--num-cpus", str(cpus)]
    # A session of its own, as systemd runs a service: a signal to its process group reaches nothing of ours.
    proc = subprocess.Popen([sys.executable, "-m", "trainyard.cli.main", "--state-dir", str(state), "serve",
                             "--port", str(port), *where], cwd=REPO, env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    _services.append(proc)

    try:
        return proc, wait_ready(proc, state, port, timeout_s=180)  # the demo's own readiness wait
    except ApiError as e:
        proc.kill()
        raise AssertionError(f"{e}:\n{log.read_text()[-3000:]}") from None


SURVIVOR = tiny_spec(model={"n_layer": 4}, steps=480, checkpoint={"every": 20}, name="survivor",
                     parallel={"pp": 2, "microbatches": 2})
"""At about 15 ms a step it ran 120 steps in 2 s, and the service's restart then found it finished by the time the
test sent SIGKILL (the service's half-second poll, the test's own and the shutdown let it run some 60 steps
past each mark): 480 leave it seconds more than the restarts need."""


def _losses(client: Client, job_id: str) -> list[float]:
    return [r["loss"] for r in client.metrics(job_id)]


def _weights(client: Client, job_id: str, where: Path) -> dict:
    return load_file(str(client.download_model(job_id, where / f"{job_id}-{MODEL_FILE}")))


def _restart_twice(state: Path, log: Path, job_id: str, proc: subprocess.Popen, client: Client,
                   ray_address: str | None = None,
                   while_down: Callable[[int, int, list[int], int], None] | None = None, last_cpus: int = 4
                   ) -> tuple[subprocess.Popen, Client]:
    """SIGTERM the service once the job made 15 more steps, start it again, SIGKILL it 15 steps later, start it
    again (an embedded Ray of `last_cpus` CPUs that time); returns the new service. (After a SIGTERM the service's
    step of a job is the step of its final checkpoint, which it goes on from: 15 more steps after a restart are
    steps the new coordinator ran.) `while_down(signal, exit code, the old service's processes, the job's last step
    the service reported)` runs while no service is up."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        running, past = client, client.job(job_id)["step"] + 15
        wait_for(lambda c=running, p=past: c.job(job_id)["step"] >= p, 300, f"the job to pass step {past}")
        ours, seen = descendants(proc.pid), running.job(job_id)["step"]
        # SIGTERM to the whole process group, as systemd and `kill -- -PGID` send it: it once reached the
        # embedded Ray's daemons too, and the shutdown then waited 60 s for a GCS that was gone and exited 1.
        # (The joined-cluster test below sends SIGTERM to the process alone.)
        os.killpg(proc.pid, sig) if sig == signal.SIGTERM else proc.send_signal(sig)
        code = proc.wait(timeout=120)
        running.close()
        if while_down is not None:
            while_down(sig, code, ours, seen)
        # After SIGKILL, the embedded Ray's daemons are orphans until the next start removes them.
        proc, client = start_serve(state, log, ray_address, last_cpus if sig == signal.SIGKILL else 4)
        wait_for(lambda o=ours: not any(alive(p) for p in o), 60, "the old service's processes to exit")
    return proc, client


@slow
def test_a_job_outlives_its_service_through_sigterm_and_sigkill(service, tmp_path):
    """Also: SIGTERM stops the service in seconds with exit code 0, its live job checkpointed and queued again
    with its waiting one, and none of its processes (the embedded Ray included) left behind. The run that is
    never interrupted is the test session's service's (the same code on the same machine: the same bits), started
    first, so that it trains while `trainyard serve` starts, which keeps one core busy, not two."""
    state, log = tmp_path / "state", tmp_path / "serve.log"
    uninterrupted = service.client()
    reference = uninterrupted.submit(SURVIVOR)
    proc, client = start_serve(state, log)

    def after_sigterm(sig: int, code: int, ours: list[int], seen: int) -> None:
        store = JobStore(state / "jobs.db")
        try:  # the signal came while the job ran, or the test's story is not the one it tells
            assert not store.get(job_id).status.is_terminal, f"the job ended before the {sig!r}"
        finally:
            store.close()
        if sig != signal.SIGTERM:
            return
        assert code == 0, log.read_text()[-3000:]
        assert len(ours) >= 4  # at least Ray's GCS and raylet, and the job's workers
        wait_for(lambda: not any(alive(p) for p in ours), 30, "the service's processes to exit")
        # The live job wrote its final checkpoint as it stopped, at or after the last step the service saw.
        saved = checkpoint.committed_steps(state / "checkpoints" / job_id)
        assert saved and saved[-1] >= seen, saved
        store = JobStore(state / "jobs.db")
        try:
            assert store.get(job_id).queued  # to go on when the service is back
            assert store.get(job_id).events[-1]["kind"] == "interrupted"
            assert store.get(waiting).queued
            # ... from that checkpoint, whose step the store shows (it showed the last poll's, behind it, and the
            # step jumped when the next coordinator first answered, before it had run a step)
            assert store.get(job_id).step == saved[-1], (store.get(job_id).step, saved)
        finally:
            store.close()

    try:
        job_id = client.submit(SURVIVOR)
        # more CPUs than the 2 of 4 the survivor leaves free: it waits in the queue
        waiting = client.submit(tiny_spec(steps=3, name="waiting", resources={"cpus_per_worker": 3}))
        wait_for(lambda: client.job(job_id)["step"] >= 1, 180, f"job {job_id} to run")
        assert client.job(waiting)["queue_position"] == 1
        # The last start has a CPU more: the waiting job runs beside the survivor once both are queued again.
        proc, client = _restart_twice(state, log, job_id, proc, client, while_down=after_sigterm, last_cpus=5)
        job = wait_terminal(client, job_id, 300)
        assert job["status"] == "SUCCEEDED", job["error"]
        assert wait_terminal(client, waiting)["status"] == "SUCCEEDED"  # it waited through the restarts, then ran
        assert {j["job_id"] for j in client.jobs()} == {job_id, waiting}
        assert wait_terminal(uninterrupted, reference)["status"] == "SUCCEEDED"
        assert _losses(client, job_id) == _losses(uninterrupted, reference)
        ours, theirs = _weights(client, job_id, tmp_path), _weights(uninterrupted, reference, tmp_path)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        events = client._call("GET", f"/api/jobs/{job_id}/events")
        kinds = [e["kind"] for e in events]
        assert kinds.count("interrupted") == 2, "; ".join(f"{e['kind']} {e.get('step')}" for e in events)
    finally:
        client.close()  # the service itself is stopped by `_no_service_left_behind`
        uninterrupted.close()


@slow
def test_on_a_joined_cluster_the_service_reattaches_to_the_running_job(ray_session, tmp_path):
    """The cluster outlives the service: through SIGTERM and SIGKILL the same workers train on, and the
    service that comes back follows them again (every step's row kept, the one run's losses)."""
    state, log = tmp_path / "state", tmp_path / "serve.log"
    proc, client = start_serve(state, log, ray.get_runtime_context().gcs_address)
    spec = {**SURVIVOR, "steps": 100_000}  # it trains on while the service restarts, until it is stopped
    try:
        job_id = client.submit(spec)
        # The service's files are its account's alone (its umask, and the state directory made private).
        assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in (state, state / "jobs.db", state / "token"))
        wait_for(lambda: client.job(job_id)["ranks"], 120, "the job's workers")
        workers = [r["actor_id"] for r in client.job(job_id)["ranks"]]
        proc, client = _restart_twice(state, log, job_id, proc, client, ray.get_runtime_context().gcs_address)
        past = client.job(job_id)["step"] + 2
        wait_for(lambda: client.job(job_id)["step"] >= past, 120, "two more steps followed")
        assert [r["actor_id"] for r in client.job(job_id)["ranks"]] == workers  # the same actors all along
        assert client.stop(job_id)["status"] == "STOPPED"
        rows = [r["step"] for r in client.metrics(job_id)]
        assert rows == list(range(len(rows))) and len(rows) >= past  # every step's row, once
        kinds = [e["kind"] for e in client._call("GET", f"/api/jobs/{job_id}/events")]
        assert kinds.count("reattached") == 2 and "interrupted" not in kinds and "failure" not in kinds
    finally:
        client.close()  # the service itself is stopped by `_no_service_left_behind`


def test_serve_starts_its_embedded_ray_with_rays_token_auth_and_answers(tmp_path):
    """`trainyard serve` as a user runs it (no RAY_AUTH_MODE in its environment): its embedded Ray requires the
    token and the service, which holds it, comes up and answers; SIGTERM stops it with exit code 0. (Before, the
    variable was set after Ray was imported: every call of the service's driver was refused, and serve exited 1.)"""
    proc, client = start_serve(tmp_path / "state", tmp_path / "serve.log", cpus=2)
    try:
        assert client.cluster()["nodes"], client.cluster()
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()[-3000:]


def test_serve_on_a_taken_port_fails_at_once_saying_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "trainyard.cli.main", "--state-dir", str(tmp_path), "serve",
                                 "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert not (tmp_path / "server.json").exists()  # nothing started, nothing advertised
