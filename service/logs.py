"""A job's rank logs, read through Ray's log API: trainyard writes no log files of its own.

Each rank is a Ray actor. Ray writes an actor's stdout and stderr to files on its node
(`worker-<worker_id>-<ray_job>-<pid>.out` and `.err`) and serves them through its state API
(`ray.util.state.get_log`, answered by the dashboard and the node's agent), also after the actor died: the
logs of an ended job can be read for as long as the Ray session and the rank's node live. A rank's Python
logging, warnings and the traceback of a failing step are on stderr; its stdout holds whatever it printed.

Ray's log API can only tail a file, not read it from a line on, so each read takes the whole file and
counts its lines: `next` (the line count) lets a follower ask only for newer lines with `since`. A rank's
log stays small (a worker writes a few lines per job, not per step), so the whole file is cheap.
"""

from __future__ import annotations

import re

import ray
from ray.util.state import get_log
from trainyard.service.errors import JobConflict, RankNotFound
from trainyard.service.store import JobRecord

STREAMS = {"stderr": "err", "stdout": "out"}
"""Stream name in the API -> the suffix of Ray's log file."""
READ_TIMEOUT_S = 10
_RAY_MARKER = re.compile(r"^:[a-z_]+:")
"""Ray's own marker lines at the top of a worker's log (`:job_id:01000000`, `:actor_name:Worker`)."""


def read_rank_log(rank: dict, stream: str = "stderr", tail: int = 1000, since: int | None = None) -> dict:
    """One rank's log: its last `tail` lines (of those from line `since` on, when given), the index of the
    first one (`start`) and the number of lines in the log (`next`). A log Ray does not hold (the Ray session
    was restarted since, or the node is gone) comes back with no lines and the reason in `error`.

    `rank` is one entry of the job's `ranks` (rank, name, node, node_id, pid, actor_id)."""
    where = {key: rank.get(key) for key in ("rank", "name", "node", "pid")}
    try:
        lines = _read(rank, STREAMS[stream])
    except Exception as e:  # noqa: BLE001 - Ray's answer for a log it cannot find or serve, said per rank
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {**where, "lines": [], "start": 0, "next": 0,
                "error": f"Ray does not hold this rank's {stream} (was Ray restarted, or the node lost?): {reason}"}
    start = max(since or 0, len(lines) - tail)
    return {**where, "lines": lines[start:], "start": start, "next": len(lines), "error": None}


def _read(rank: dict, suffix: str) -> list[str]:
    # By actor id: a pid alone may since have been reused on that node by another worker.
    where = ({"actor_id": rank["actor_id"]} if rank.get("actor_id")
             else {"pid": rank["pid"], "node_id": rank["node_id"]})
    # The Ray this process is connected to: left to itself, Ray's log API looks for a Ray on this machine and
    # gives up when it finds several (another service's embedded Ray, say).
    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    chunks = get_log(address=address, **where, suffix=suffix, tail=-1, timeout=READ_TIMEOUT_S, errors="replace",
                     filter_ansi_code=True)
    text = "".join(chunks)
    # Only whole lines: a line still being written would be counted now and again once it is complete.
    text = text[:text.rfind("\n") + 1]
    return [line for line in text.splitlines() if not _RAY_MARKER.match(line)]


def job_logs(job: JobRecord, rank: int | None, stream: str, tail: int, since: int | None) -> dict:
    """The log of one rank of `job`, or of every rank (`read_rank_log`); JobConflict when the job has no ranks
    yet, RankNotFound for a rank it does not have."""
    if not job.ranks:
        state = "has not started its workers yet" if not job.status.is_terminal else "never started its workers"
        raise JobConflict(f"job {job.job_id} is {job.status} and {state}, so it has no rank logs")
    chosen = [r for r in job.ranks if rank is None or r["rank"] == rank]
    if not chosen:
        raise RankNotFound(f"job {job.job_id} has no rank {rank}; its ranks are 0 to {len(job.ranks) - 1}")
    return {"job_id": job.job_id, "status": job.status.value, "stream": stream,
            "ranks": [read_rank_log(r, stream, tail, since) for r in chosen]}
