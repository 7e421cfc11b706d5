"""What a submitted job reads, checked at submit, whatever its layout: its datasets, the checkpoint it resumes and
the trackers it logs to (`check_inputs`); and the steps its `data.epochs` allow (`bound_by_epochs`). The training
data is opened once by the caller where both need it: whole examples are read (and, with `data.packing`, packed) in
Python as it opens, on the API's thread."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from trainyard.actors import tracking
from trainyard.parallel.config import JobConfig
from trainyard.parallel.data.datasets import Dataset, open_dataset
from trainyard.parallel.data.examples import epochs_steps


def check_inputs(config: JobConfig, resume_point: Callable[[JobConfig], object], train: Dataset | None = None) -> None:
    """Raises naming the field and the rule: a tracker whose extra is not installed, a dataset that cannot be read
    (the training data opened here unless `train` is it already), a checkpoint `resume_from` names that is not there
    (`resume_point`, which checks it without hashing it)."""
    missing = tracking.missing_extra(config)
    if missing is not None:
        raise missing
    if train is None:
        open_dataset(config)
    if config.eval.every > 0:
        open_dataset(config, "val")
    resume_point(config)


def bound_by_epochs(config: JobConfig, train: Dataset | None) -> tuple[JobConfig, list[dict]]:
    """`data.epochs` ends the job first when its passes over `train` (its training data, opened) take fewer steps
    than `steps`: the job is stored with those steps (so its learning-rate schedule ends with it), and an event says
    so."""
    if config.data.epochs is None or train is None:
        return config, []
    sequences = train.num_samples
    steps = epochs_steps(config.data.epochs, sequences, config.global_batch)
    if steps >= config.steps:
        return config, []
    event = {"time": time.time(), "kind": "steps_from_epochs", "steps": steps, "asked": config.steps,
             "cause": f"data.epochs={config.data.epochs} over {sequences} sequences of whole examples at "
                      f"global_batch={config.global_batch}: {steps} steps, fewer than steps={config.steps}"}
    return dataclasses.replace(config, steps=steps), [event]
