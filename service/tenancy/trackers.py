"""Where jobs' experiment trackers may send their runs: the operator's settings (`trainyard serve --mlflow-uri URI
--wandb-project P --wandb-entity E`), never a user's. A user's job logs to the operator's MLflow server (or, with
none set, to a file store in the job's own directory) and to the operator's W&B project under the operator's key;
a user's spec that names another MLflow URI, W&B project or entity is a 422 naming the field. An admin's spec may
name its own. Pure: the rule and the config it gives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainyard.parallel.config import JobConfig, RuleError, WandbConfig

DEFAULT_WANDB_PROJECT = WandbConfig().project


@dataclass(frozen=True)
class TrackerPolicy:
    mlflow_uri: str | None = None
    wandb_project: str | None = None
    wandb_entity: str | None = None

    def apply(self, config: JobConfig, admin: bool) -> JobConfig:
        """`config` with the operator's destinations filled in; RuleError where a user's spec names another."""
        tracking = config.tracking
        mlflow, wandb = tracking.mlflow, tracking.wandb
        if mlflow is not None:
            if mlflow.uri is not None and mlflow.uri != self.mlflow_uri and not admin:
                raise RuleError("tracking.mlflow.uri", "the MLflow server is the operator's (`trainyard serve "
                                                       "--mlflow-uri`); leave the field out")
            mlflow = dataclasses.replace(mlflow, uri=mlflow.uri if admin and mlflow.uri else self.mlflow_uri)
        if wandb is not None:
            operators = self.wandb_project or DEFAULT_WANDB_PROJECT
            if wandb.project not in (DEFAULT_WANDB_PROJECT, operators) and not admin:
                raise RuleError("tracking.wandb.project", "the W&B project is the operator's (`trainyard serve "
                                                          "--wandb-project`); leave the field out")
            if wandb.entity is not None and wandb.entity != self.wandb_entity and not admin:
                raise RuleError("tracking.wandb.entity", "the W&B entity is the operator's (`trainyard serve "
                                                         "--wandb-entity`); leave the field out")
            chosen = admin and wandb.project != DEFAULT_WANDB_PROJECT
            wandb = dataclasses.replace(wandb, project=wandb.project if chosen else operators,
                                        entity=wandb.entity if admin and wandb.entity else self.wandb_entity)
        return dataclasses.replace(config, tracking=dataclasses.replace(tracking, mlflow=mlflow, wandb=wandb))
