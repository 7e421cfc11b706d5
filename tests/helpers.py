"""Helpers shared by the tests: a small JobSpec, a dataset with one bad token, and waiting with a deadline."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SLOW_TESTS = os.environ.get("TRAINYARD_SLOW_TESTS") == "1"
"""`make test-slow` sets it: the minutes-long stories run then, not in `make test` (whose budget is 8 minutes)."""
SLOW = [pytest.mark.slow, pytest.mark.skipif(not SLOW_TESTS, reason="slow: run with `make test-slow`")]
"""The marks of a slow test: `pytestmark = SLOW`, `pytest.param(..., marks=SLOW)`, or `@slow` on one test."""


def slow(test: Callable) -> Callable:
    """Mark `test` slow: `make test-slow` (`-m slow`, TRAINYARD_SLOW_TESTS=1) runs it, `make test` skips it."""
    for mark in reversed(SLOW):
        test = mark(test)
    return test


def wait_for(condition: Callable[[], object], timeout_s: float = 120.0, what: str = "condition") -> object:
    """Poll `condition` until it returns something truthy; fail the test after `timeout_s`. The first polls
    are 50 ms apart, later ones up to 250 ms: a wait for a job to run or end (most of the suite's waiting) then
    costs a fifth of the requests, and their CPU, on a two-core machine where the jobs need it."""
    deadline, pause = time.monotonic() + timeout_s, 0.05
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(pause)
        pause = min(0.25, pause * 1.2)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def tiny_spec(**overrides) -> dict:
    """A job small enough to run in seconds on two cores."""
    spec = {
        "name": "tiny",
        "seed": 7,
        "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "vocab_size": 256, "seq_len": 16},
        "data": {"kind": "text", "path": str(REPO / "examples" / "corpus.txt")},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "steps": 4,
        "global_batch": 8,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


THREE_D_SPEC = tiny_spec(model={"family": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2,
                                "moe": {"experts": 4, "top_k": 2, "every": 2}},
                         global_batch=8, steps=3,
                         parallel={"dp": 2, "pp": 2, "tp": 2, "ep": 2, "microbatches": 2, "schedule": "1f1b"})
"""The flagship job through the service (`three_d_job` in conftest.py): llama with grouped-query attention and
mixture-of-experts blocks (1 and 3, one on each stage) at (dp2, pp2, tp2, ep2)."""


def wait_terminal(client, job_id: str, timeout_s: float = 180.0) -> dict:
    return wait_for(lambda: (j := client.job(job_id))["status"] in ("SUCCEEDED", "FAILED", "STOPPED") and j,
                    timeout_s, f"job {job_id} to end")



def run_all(client, specs: dict[str, dict], timeout_s: float = 600.0) -> dict[str, tuple[dict, list[dict]]]:
    """Submit every spec at once (they queue for resources), wait for each to succeed; key -> (job, metrics)."""
    job_ids = {key: client.submit(spec) for key, spec in specs.items()}
    out = {}
    for key, job_id in job_ids.items():
        job = wait_terminal(client, job_id, timeout_s=timeout_s)
        assert job["status"] == "SUCCEEDED", f"{key}: {job['error']}"
        out[key] = (job, client.metrics(job_id))
    return out


def with_one_bad_token(spec: dict, tmp_path: Path, bad_dp_rank: int, bad_microbatch: int) -> tuple[dict, int]:
    """`spec` reading a tokens file with one out-of-vocabulary id (300), placed in a sample that step 0
    reads only in micro-batch `bad_microbatch` of data-parallel rank `bad_dp_rank`. Returns (spec, offset).
    """
    import numpy as np
    from trainyard.parallel.data.sampler import global_batch_ids, rank_share

    seq_len, length = spec["model"]["seq_len"], 4000
    par = spec.get("parallel", {})
    dp, m = par.get("dp", 1), par.get("microbatches", 1)
    ids = global_batch_ids(spec["seed"], 0, spec["global_batch"], length - seq_len)
    positions = {(r, mb): {p for i in sample_ids for p in range(i, i + seq_len + 1)}
                 for r in range(dp) for mb, sample_ids in enumerate(rank_share(ids, r, dp, m))}
    bad = positions.pop((bad_dp_rank, bad_microbatch))
    offset = min(bad - set().union(*positions.values()))
    tokens = np.arange(length, dtype=np.uint16) % 256
    tokens[offset] = 300
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    return {**spec, "data": {"kind": "tokens", "path": str(path)}}, offset


def live_actor(name: str) -> bool:
    """Whether a named actor of the service's namespace is alive."""
    import ray
    from trainyard.actors.naming import NAMESPACE

    try:
        ray.get_actor(name, namespace=NAMESPACE)
        return True
    except ValueError:
        return False


@contextlib.contextmanager
def small_file_system(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "2m") mounted at `where`: a disk a test can fill and free. Skips the test where
    mounting is refused (not root, or no mount permission)."""
    where.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
