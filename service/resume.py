"""Checking a `resume_from` on the submit path: the source job exists, trained the same model and optimizer,
and has the checkpoint whole (every file there with the size its manifest says). Its hashes are not read
here: hashing a checkpoint of tens of GB takes minutes, and this runs on the API's request path (and the
admission thread); the coordinator verifies them in a thread before it loads the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainyard.parallel.config import JobConfig
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import PlanError
from trainyard.parallel.plan.cadence import is_done
from trainyard.parallel.spec import parse_spec, spec_to_dict
from trainyard.service.store import JobStore


def resume_point(store: JobStore, checkpoint_root: Callable[[str, JobConfig], Path], config: JobConfig
             ) -> tuple[str, int] | None:
    """The checkpoint (directory, step) `resume_from` names, checked: the job exists, its model and
    optimizer equal this spec's (`optimizer.offload` may differ), the checkpoint is whole (every file there with
    its size: its hashes are verified by the coordinator, off this request's path), and steps are left to train."""
    wanted = config.resume_from
    if wanted is None:
        return None
    source = store.get(wanted.job_id)
    if source is None:
        raise PlanError("resume_from.job_id", f"no job {wanted.job_id}")
    source_config = parse_spec(source.spec)
    differences = _differences(spec_to_dict(source_config), spec_to_dict(config), ("model", "optimizer"), _WHERE_ONLY)
    if differences:
        raise PlanError("resume_from", f"job {wanted.job_id} trained a different model or optimizer: "
                                       + "; ".join(differences))
    root = checkpoint_root(source.job_id, source_config)
    if wanted.step is None:
        found = checkpoint.latest_valid(root, hashes=False)
        if found is None:
            raise PlanError("resume_from.job_id", f"job {wanted.job_id} has no intact checkpoint (yet)")
        step, directory = found.step, found.directory
    else:
        step, directory = wanted.step, checkpoint.step_dir(root, wanted.step)
        problem = "it was never written" if not directory.is_dir() else checkpoint.verify(directory, hashes=False)
        if problem:
            raise PlanError("resume_from.step", f"job {wanted.job_id} has no intact checkpoint of step {step} "
                                                f"({problem}); it has steps {checkpoint.committed_steps(root)}")
    if is_done(step, config.steps):
        raise PlanError("steps", f"steps={config.steps}, but the checkpoint is after step {step}: nothing "
                                 "left to train")
    return str(directory), step


_WHERE_ONLY = frozenset({"optimizer.offload"})
"""Fields of those compared that say where the state lives, not what it is (losses equal either way): a job may
resume with another value, as at another layout (e.g. offloading the optimizer of a job that ran out of memory)."""


def _differences(a: dict, b: dict, sections: tuple[str, ...], ignored: frozenset[str] = frozenset()) -> list[str]:
    """`section.field: X there, Y here` for each field that differs between two specs' sections, but `ignored`."""
    out = []
    for section in sections:
        for key in sorted(set(a[section]) | set(b[section])):
            if f"{section}.{key}" not in ignored and a[section].get(key) != b[section].get(key):
                out.append(f"{section}.{key}: {a[section].get(key)!r} there, {b[section].get(key)!r} here")
    return out
