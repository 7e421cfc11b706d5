"""Helpers shared by the tests: a small JobSpec, and waiting on a condition with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def wait_for(condition: Callable[[], object], timeout_s: float = 120.0, what: str = "condition") -> object:
    """Poll `condition` until it returns something truthy; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
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


def wait_terminal(client, job_id: str, timeout_s: float = 180.0) -> dict:
    return wait_for(lambda: (j := client.job(job_id))["status"] in ("SUCCEEDED", "FAILED", "STOPPED") and j,
                    timeout_s, f"job {job_id} to end")
