"""Where a job's files go (`JobStorage`, the service decides) and what a checkpoint's manifest records of the
job (`checkpoint_info`). The JobSpec is dumped by `parallel.spec`, the one adapter."""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.parallel.config import JobConfig
from trainyard.parallel.spec import spec_to_dict


@dataclass(frozen=True)
class JobStorage:
    """Where a job's checkpoints and trained model are written (the service decides), and what it resumes."""

    checkpoint_root: str
    model_path: str
    resume: tuple[str, int] | None = None
    """(checkpoint directory, its step) to start from: checked for its files and sizes by the service; its
    hashes are verified by the coordinator off the event loop (`actors.controller`)."""
    resume_falls_back: bool = False
    """`resume` is the newest checkpoint of the job `resume_from` names (no step asked for): when its hashes show it
    damaged, that job's newest intact one before it is taken instead (a named step is not replaced)."""
    events: tuple[dict, ...] = ()
    """The job's events so far (a job relaunched after the service came back keeps its history)."""


def checkpoint_info(config: JobConfig) -> dict:
    """What a checkpoint's manifest records of the job: what a job resuming from it must match."""
    spec = spec_to_dict(config)
    return {"model": spec["model"], "optimizer": spec["optimizer"], "seed": config.seed}
