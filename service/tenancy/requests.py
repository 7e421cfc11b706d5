"""A user's request, held to what they may ask before the manager queues it: the paths and jobs a spec names
(`confine`: resolved against the user, `service.tenancy.access`), the priority and trackers it may ask for
(`for_user`), the storage its owner has left (`check_storage`, `upload_limit`), and an elastic job's `dp.max` within
the owner's whole quota (`elastic_within_quota`). Another user's job answers as a missing one; no error quotes
data. The manager calls it on every submit; the API's upload route asks it for the limit."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.actors.scaling_policy.scaling import largest_size
from trainyard.actors.state import JobStatus
from trainyard.parallel.config import JobConfig, RuleError
from trainyard.parallel.plan import Plan, with_dp_max
from trainyard.parallel.spec import parse_spec
from trainyard.service.errors import JobConflict
from trainyard.service.paths import JobPaths
from trainyard.service.store import JobRecord, JobStore
from trainyard.service.tenancy import quota, uploads
from trainyard.service.tenancy.access import Access
from trainyard.service.tenancy.tinker_paths import TinkerPaths
from trainyard.service.tenancy.trackers import TrackerPolicy
from trainyard.service.tenancy.uploads import Uploads
from trainyard.service.tenancy.users import User


class Tenancy:
    def __init__(self, store: JobStore, state_dir: Path, paths: JobPaths, quotas: Callable[[str], quota.Quota],
                 trackers: TrackerPolicy, plan: Callable[[JobConfig], Plan]):
        """`paths`: where jobs' files live; `quotas`: each user's, by name; `trackers`: the operator's tracker
        settings; `plan`: the manager's submit-time checks (an elastic job capped to its quota is planned again)."""
        self.store, self.paths, self.quotas, self.trackers, self._plan = store, paths, quotas, trackers, plan
        self.access = Access(state_dir, paths.data_dir, owns=self._owns)
        self.uploads = Uploads(self.access.uploads_root)
        self.tinker = TinkerPaths(self.access.data_dir / "tinker")  # the Tinker API's saved state, per user

    # --- what a spec names --------------------------------------------------------------------------------------

    def confine(self, spec: Any, user: User) -> Any:
        """A submitted spec (parsed JSON, before validation) with every path and job it names resolved against
        `user`: paths under their areas (`service.tenancy.access`), `resume_from.job_id` and `init_from.job_id` jobs
        of theirs (another user's answers as a missing one), `init_from.job_id` resolved to that job's model as a
        Hugging Face directory (`init_from.hf`). RuleError naming the field otherwise."""
        spec = self.access.confine(user.owner, spec)
        if not isinstance(spec, dict):
            return spec
        resume, init = spec.get("resume_from"), spec.get("init_from")
        if isinstance(resume, dict) and isinstance(resume.get("job_id"), str):
            self.job_of(user, resume["job_id"], "resume_from.job_id")
        if isinstance(init, dict) and isinstance(init.get("job_id"), str):
            job = self.job_of(user, init["job_id"], "init_from.job_id")
            init["hf"] = str(self._model_directory(job))
        return spec

    def job_of(self, user: User, job_id: str, field: str) -> JobRecord:
        """Job `job_id` if `user` may name it (theirs; any, for an admin); else RuleError, as for no such job."""
        job = self.store.get(job_id)
        if job is None or not (user.admin or job.owner == user.name):
            raise RuleError(field, f"no job {job_id}")
        return job

    def _owns(self, job_id: str, owner: str) -> bool:
        job = self.store.get(job_id)
        return job is not None and job.owner == owner

    def _model_directory(self, job: JobRecord) -> Path:
        """An ended job's trained model as a Hugging Face directory (made once, beside its model file)."""
        path = self.paths.model_path(job.job_id)
        if job.status not in (JobStatus.SUCCEEDED, JobStatus.STOPPED) or not path.is_file():
            raise RuleError("init_from.job_id", f"job {job.job_id} is {job.status} without a model; a job starts "
                                                "from one that ended SUCCEEDED or STOPPED")
        from trainyard.service.hf_export import hf_directory  # torch: only when asked for

        return hf_directory(path, job.spec)

    # --- what a user may ask for --------------------------------------------------------------------------------

    def for_user(self, config: JobConfig, user: User) -> JobConfig:
        """What a user's spec may not ask for: a priority above their `max_priority` (RuleError on `priority`),
        trackers other than the operator's (`service.tenancy.trackers`); the config with the operator's trackers."""
        if user.max_priority is not None and config.priority > user.max_priority:
            raise RuleError("priority", f"at most {user.max_priority} for user {user.name} (an admin sets it: "
                                        "`trainyard token update NAME --max-priority N`)")
        return self.trackers.apply(config, user.admin)

    def elastic_within_quota(self, config: JobConfig, plan: Plan, user: User) -> tuple[JobConfig, Plan, list[dict]]:
        """An elastic job whose `dp.max` is more than its owner's whole quota holds, with `dp.max` lowered to the
        largest size the quota holds and the plan's rules allow (and an event saying so); else as it is."""
        if plan.dp_range is None:
            return config, plan, []
        low, high = plan.dp_range
        fits = quota.replicas_within(self.quotas(user.name), quota.charge(plan, at_dp=1))
        if fits is None or fits >= high or fits < low:  # below the minimum: the quota check refuses it
            return config, plan, []
        size = largest_size(plan, fits)
        if size is None:
            return config, plan, []
        capped = with_dp_max(config, size)
        event = {"time": time.time(), "kind": "elastic_within_quota", "dp_max": size, "asked": high,
                 "cause": f"parallel.dp.max={high} is more than user {user.name}'s quota holds: the job grows to "
                          f"dp={size} at most"}
        return capped, self._plan(capped), [event]

    # --- storage ------------------------------------------------------------------------------------------------

    def storage_used(self, user: str) -> int:
        """The bytes of `user`'s uploads, of their jobs' checkpoints and models, and of their Tinker state."""
        folders = [self.uploads.folder(user), self.tinker.user_root(user)]
        for job in self.store.list(user):
            config = parse_spec(job.spec)
            folders += [self.paths.model_path(job.job_id).parent, self.paths.checkpoint_root(job.job_id, config)]
        return uploads.storage_used(folders)

    def check_storage(self, user: User) -> None:
        """JobConflict when `user`'s storage quota is used up (a new job would write checkpoints and a model)."""
        if user.max_storage_bytes is not None and self.storage_used(user.name) >= user.max_storage_bytes:
            raise JobConflict(self._storage_full(user))

    def upload_limit(self, user: User, limit: int) -> int:
        """The most bytes `user`'s next upload may take: `limit` (one upload's), or what their storage quota
        leaves (JobConflict: nothing is left)."""
        if user.max_storage_bytes is not None:
            left = user.max_storage_bytes - self.storage_used(user.name)
            if left <= 0:
                raise JobConflict(self._storage_full(user))
            limit = min(limit, left)
        return limit

    @staticmethod
    def _storage_full(user: User) -> str:
        return (f"user {user.name}'s storage quota ({user.max_storage_bytes} bytes of uploads, checkpoints and "
                "models) is used up; delete uploads (`trainyard files rm`) or jobs (`trainyard delete`)")
