"""A job stopped while it waits in the queue after it ran (the service's restart interrupted it): what it leaves is
what a stop of a running job leaves, from its latest checkpoint (`stop_interrupted`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import ray
from trainyard.actors.journal import read_metrics_log, steps_logged
from trainyard.parallel.config import JobConfig
from trainyard.parallel.io import checkpoint
from trainyard.parallel.spec import parse_spec
from trainyard.service.paths import JobPaths
from trainyard.service.store import JobRecord, JobStore

log = logging.getLogger("trainyard.manager")


@ray.remote(num_cpus=0)
def _export_latest(config: JobConfig, root: str, out: str) -> int | None:
    """The model of a job's latest intact checkpoint (hashed) written to `out`; its step (None: no checkpoint). A
    Ray task: the service imports no torch, and hashes no checkpoint on the API's path."""
    from trainyard.parallel.io.export import export_model

    found = checkpoint.latest_valid(Path(root), at_most=steps_logged(Path(root)))
    if found is None:
        return None
    export_model(config, found.directory, found.step, Path(out))
    return found.step


def stop_interrupted(store: JobStore, paths: JobPaths, job: JobRecord) -> None:
    """A job stopped in the queue that ran before (the service's restart interrupted it): as a stop of a running
    job, its model is that of its latest checkpoint and its steps and rows end there (the rows the store had not
    read yet come from the metrics log beside the checkpoints). A job that never ran has none of these."""
    config = parse_spec(job.spec)
    root = paths.checkpoint_root(job.job_id, config)
    if steps_logged(root) is None:
        return
    try:
        out = paths.model_path(job.job_id)
        step = ray.get(_export_latest.remote(config, str(root), str(out)), timeout=300)
    except Exception as e:  # noqa: BLE001 - the job is stopped all the same, without a model
        log.warning("job %s: stopped in the queue; no model from its checkpoints (%s)", job.job_id, e)
        return
    if step is None:
        return
    if store.get(job.job_id) is None:  # deleted meanwhile: its files go with it
        shutil.rmtree(paths.model_path(job.job_id).parent, ignore_errors=True)
        return
    store.add_metrics(job.job_id, [r for r in read_metrics_log(root) if r["step"] < step])
    store.drop_metrics_from(job.job_id, step)
    store.update(job.job_id, step=step)
