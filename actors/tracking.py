"""Experiment tracking: the job's coordinator hands each step's metrics row (and the spec, once) to the trackers
the spec asks for (`tracking`): TensorBoard, Weights & Biases, MLflow. No rank talks to a tracker.

Each tracker is a small class over its library's own writer (torch's `SummaryWriter`, `wandb.init` /
`run.log`, `MlflowClient`), imported only when a job asks for it: the libraries are the optional extra
`trainyard[track]`, and `missing_extra` is the submit-time check that turns a missing one into a 422.

A row is logged once per step, in step order: steps run again after a recovery (rows trimmed and replayed,
bit-identical on the uninterrupted curve) are not logged twice, and a coordinator restarted by Ray goes on
after the last row it finds in the metrics log. A tracker that fails (a full disk, a lost server) is logged
and dropped; the job trains on.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from trainyard.parallel.config import JobConfig, RuleError
from trainyard.parallel.spec import spec_to_dict

log = logging.getLogger("trainyard.coordinator")

EXTRA = "pip install 'trainyard[track]'"
LIBRARIES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""Spec field -> the module it needs."""

SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "epoch")
"""The row's figures a tracker gets, where the row has them."""


def missing_extra(config: JobConfig) -> RuleError | None:
    """The first tracker the spec asks for whose library is not installed here (the coordinator runs where
    the service does, or on a node of the same image)."""
    for field, module in LIBRARIES.items():
        if _wanted(config, field) and importlib.util.find_spec(module) is None:
            return RuleError(f"tracking.{field}", f"{module} is not installed: {EXTRA}")
    return None


def locations(config: JobConfig, root: Path) -> dict[str, str]:
    """Where each tracker of the job writes: TensorBoard's logdir, W&B's run directory's parent, MLflow's URI."""
    out = {}
    if config.tracking.tensorboard:
        out["tensorboard"] = str(root / "tensorboard")
    if config.tracking.wandb is not None:
        out["wandb"] = str(root / "wandb")
    if config.tracking.mlflow is not None:
        out["mlflow"] = _mlflow_uri(config, root)
    return out


def scalars(row: dict) -> dict[str, float]:
    return {key: float(row[key]) for key in SCALARS if row.get(key) is not None}


def flat_params(spec: dict, prefix: str = "") -> Iterator[tuple[str, str]]:
    """The spec as dotted key -> value strings (hyper-parameters for trackers that take flat ones)."""
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flat_params(value, f"{name}.")
        else:
            yield name, json.dumps(value) if isinstance(value, list | tuple) else str(value)


class Tracker(Protocol):
    def __init__(self, job_id: str, config: JobConfig, root: Path, spec: dict) -> None: ...

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, status: str) -> None: ...


class Trackers:
    """The job's trackers, opened on the first row: `add(row)` after the row is in the metrics log."""

    def __init__(self, job_id: str, config: JobConfig, root: Path, last_logged: int = -1):
        self.job_id, self.config, self.root = job_id, config, root
        self.last_logged = last_logged
        self.open: list[Tracker] | None = None

    def add(self, row: dict) -> None:
        if row["step"] <= self.last_logged:
            return
        self.last_logged = row["step"]
        if self.open is None:
            self.open = self._open()
        values = scalars(row)
        for tracker in list(self.open):
            try:
                tracker.log(row["step"], values)
            except Exception:  # a tracker must never fail the job
                log.exception("job %s: tracker %s failed; dropped", self.job_id, type(tracker).__name__)
                self.open.remove(tracker)

    def close(self, status: str) -> None:
        for tracker in self.open or []:
            try:
                tracker.close(status)
            except Exception:
                log.exception("job %s: closing tracker %s failed", self.job_id, type(tracker).__name__)
        self.open = []

    def _open(self) -> list[Tracker]:
        spec = spec_to_dict(self.config)
        makers: list[tuple[object, type[Tracker]]] = [(self.config.tracking.tensorboard, _TensorBoard),
                                                        (self.config.tracking.wandb, _Wandb),
                                                        (self.config.tracking.mlflow, _Mlflow)]
        opened: list[Tracker] = []
        for wanted, make in makers:
            if not wanted:
                continue
            try:
                opened.append(make(self.job_id, self.config, self.root, spec))
            except Exception:
                log.exception("job %s: could not open tracker %s; the job trains on without it", self.job_id,
                              make.__name__)
        return opened


class _TensorBoard:
    def __init__(self, job_id: str, config: JobConfig, root: Path, spec: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(root / "tensorboard"))
        self.writer.add_text("spec", f"```\n{json.dumps(spec, indent=2)}\n```")

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # once a step: a reader sees each step as it ends

    def close(self, status: str) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, job_id: str, config: JobConfig, root: Path, spec: dict):
        import wandb

        wanted = config.tracking.wandb
        assert wanted is not None
        mode = wanted.mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") or _netrc_has("api.wandb.ai") else "offline"
        (root / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=wanted.project, entity=wanted.entity, id=job_id, name=config.name,
                              config=spec, dir=str(root), mode=mode, resume="allow", reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off", save_code=False,
                                                      x_disable_stats=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "SUCCEEDED" else 1)


class _Mlflow:
    def __init__(self, job_id: str, config: JobConfig, root: Path, spec: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        wanted = config.tracking.mlflow
        assert wanted is not None
        uri = _mlflow_uri(config, root)
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store (in maintenance) behind this opt-in; a database backend needs
            # SQLAlchemy, which mlflow-skinny leaves out. A file store is what a job without a server wants.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(wanted.experiment)
        experiment = found.experiment_id if found else self.client.create_experiment(wanted.experiment)
        # The run of this job, if a coordinator before this one (restarted by Ray) made it.
        runs = self.client.search_runs([experiment], filter_string=f"tags.trainyard_job_id = '{job_id}'")
        if runs:
            self.run_id = runs[0].info.run_id
        else:
            self.run_id = self.client.create_run(experiment, run_name=config.name,
                                                 tags={"trainyard_job_id": job_id}).info.run_id
            # MLflow caps a parameter's value at 6000 characters; a spec's fields are short.
            params = [Param(k, v[:6000]) for k, v in flat_params(spec)]
            for i in range(0, len(params), 100):  # log_batch takes at most 100 parameters a call
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if status == "SUCCEEDED" else "FAILED")


def _mlflow_uri(config: JobConfig, root: Path) -> str:
    wanted = config.tracking.mlflow
    return wanted.uri if wanted is not None and wanted.uri else (root / "mlruns").as_uri()


def _netrc_has(host: str) -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _wanted(config: JobConfig, field: str) -> bool:
    return bool(getattr(config.tracking, field))
