"""Response models of the REST API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from trainyard.parallel.config import MAX_DEGREE, MAX_STEPS, NOT_BOOL

if TYPE_CHECKING:
    from trainyard.service.store import JobRecord


class JobCreated(BaseModel):
    job_id: str


class JobInfo(BaseModel):
    job_id: str
    name: str
    owner: str
    """The user who submitted it (`admin`: the state directory's token, or a job from before users)."""
    kind: str = "job"
    """`job`: a JobSpec's loop; `tinker`: a Tinker training client, whose steps the user's own program drives (its
    job id is the client's model id)."""
    status: str
    step: int
    """Steps finished so far."""
    steps: int
    error: str | None = None
    """The failure, with the worker's traceback, when status is FAILED."""
    actors: list[str] = []
    """Ray actor names (coordinator first), as listed in the Ray dashboard."""
    ranks: list[dict] = []
    """Where each rank runs (rank, name, node, pid, device), once its workers are set up, and `baseline_rss_bytes`:
    its process's resident memory before its trainer was built (Ray's worker, torch and their imports)."""
    priority: int = 0
    queue_position: int | None = None
    """1 for the next job to be admitted; None once the job has left the queue."""
    waiting_for: dict | None = None
    """For a waiting job: `needed` and `free` resources (CPU, GPU) and the `reason` it waits."""
    dashboard_url: str | None = None
    created_at: float
    admitted_at: float | None = None
    """When the job's resources were reserved (it left the queue)."""
    ended_at: float | None = None
    updated_at: float
    spec: dict | None = None


class RankLog(BaseModel):
    rank: int
    name: str | None = None
    """The rank's coordinates, `pp<i>-tp<j>-dp<k>`."""
    node: str | None = None
    pid: int | None = None
    lines: list[str]
    """The log's last `tail` lines (of those from line `since` on, when asked)."""
    start: int
    """Index in the log of the first line returned."""
    next: int
    """Lines in the log so far: pass it as `since` to get only the lines written after this answer."""
    error: str | None = None
    """Why there are no lines, when Ray no longer holds the log (e.g. Ray was restarted since)."""


class JobLogs(BaseModel):
    job_id: str
    status: str
    stream: str
    ranks: list[RankLog]


class ScaleRequest(BaseModel):
    """A new data-parallel size for a running job (the global batch stays; micro-batches per rank follow)."""

    model_config = ConfigDict(extra="forbid")
    dp: Annotated[int, Field(ge=1, le=MAX_DEGREE), NOT_BOOL]


class FaultDrill(BaseModel):
    """A fault to inject into a running job (`trainyard serve --allow-fault-injection` only)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["kill_worker", "hang_worker", "oom_worker", "oom_kill_worker", "kill_coordinator",
                  "kill_worker_in_recovery", "kill_worker_in_export", "slow_rank"]
    """kill_worker: the rank's process exits; hang_worker: the rank's step never returns; oom_worker: the rank's
    memory is capped just above what it holds (RLIMIT_AS) and its step asks for more, which the OS refuses;
    oom_kill_worker: the rank moves into a memory cgroup of its own limited to 64 MiB more and asks for more, and
    the kernel's OOM killer SIGKILLs it (needs a writable memory cgroup: root or a delegated subtree);
    kill_worker_in_recovery: the rank's process is killed as the ranks take the job's state in the next
    recovery (a failure during a recovery); kill_worker_in_export: the rank's process is killed as the job's model
    is exported at its end (after its final checkpoint); slow_rank: from `at_step` on, each of the rank's steps
    takes `factor` times as long (the rank sleeps (factor - 1) times the step's measured time after it: a
    straggler to measure the replica sync modes against)."""
    rank: Annotated[int, Field(ge=0, le=MAX_DEGREE), NOT_BOOL]
    at_step: Annotated[int, Field(ge=0, le=MAX_STEPS), NOT_BOOL] = 0
    """The step at which (or the first step after which) it happens."""
    factor: Annotated[float, Field(ge=1.0, le=100.0), NOT_BOOL] = 3.0
    """slow_rank: how many times as long the rank's steps take (the other kinds ignore it)."""


class ClusterInfo(BaseModel):
    nodes: int
    cpus: float
    gpus: float
    ray_address: str | None
    dashboard_url: str | None


def job_info(job: JobRecord, dashboard_url: str | None, queue: dict[str, tuple[int, dict]],
             with_spec: bool = True) -> JobInfo:
    """`queue` maps each waiting job to (position, what it waits for), as `JobManager.queue_view` gives it."""
    position, waiting = queue.get(job.job_id, (None, None))
    return JobInfo(job_id=job.job_id, name=job.name, owner=job.owner, kind=job.kind, status=job.status.value,
                   step=job.step,
                   steps=job.steps, error=job.error, actors=job.actors, ranks=job.ranks, priority=job.priority,
                   queue_position=position, waiting_for=waiting, dashboard_url=dashboard_url,
                   created_at=job.created_at, admitted_at=job.admitted_at, ended_at=job.ended_at,
                   updated_at=job.updated_at, spec=job.spec if with_spec else None)
