"""Where a job's files live: its checkpoints (under `checkpoint.path`, or the service's data directory) and
its trained model (always under the data directory)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainyard.parallel.config import JobConfig
from trainyard.parallel.io import checkpoint


@dataclass(frozen=True)
class JobPaths:
    data_dir: Path

    def checkpoint_root(self, job_id: str, config: JobConfig) -> Path:
        base = Path(config.checkpoint.path).expanduser() if config.checkpoint.path else self.data_dir / "checkpoints"
        return base / job_id

    def model_path(self, job_id: str) -> Path:
        return self.data_dir / "models" / job_id / checkpoint.MODEL_FILE
