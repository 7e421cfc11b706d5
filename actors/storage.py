"""Where a job's files go (`JobStorage`, the service decides) and what a checkpoint's manifest records of the
job (`checkpoint_info`). The JobSpec is dumped with pydantic's own adapter for the frozen config, so the
coordinator depends on `parallel/` only, not on the web layer in `api/`."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import TypeAdapter
from trainyard.parallel.config import JobConfig

_SPEC = TypeAdapter(JobConfig)


@dataclass(frozen=True)
class JobStorage:
    """Where a job's checkpoints and trained model are written (the service decides), and what it resumes."""

    checkpoint_root: str
    model_path: str
    resume: tuple[str, int] | None = None
    """(checkpoint directory, its step) to start from: checked for its files and sizes by the service; its
    hashes are verified by the coordinator off the event loop (`actors.restore`)."""
    events: tuple[dict, ...] = ()
    """The job's events so far (a job relaunched after the service came back keeps its history)."""


def checkpoint_info(config: JobConfig) -> dict:
    """What a checkpoint's manifest records of the job: what a job resuming from it must match."""
    spec = _SPEC.dump_python(config, mode="json")
    return {"model": spec["model"], "optimizer": spec["optimizer"], "seed": config.seed}
