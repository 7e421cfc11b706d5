"""The job store: SQLite (WAL) in the state directory, the service's only durable state.

It holds each job's spec, status, progress and error, one metrics row per finished step, and the queue: a
waiting job is a PENDING row with no `admitted_at`, ordered by priority (higher first) then submission. A
restarted service therefore still lists every job and its curve, and its queue. Events are rows of their
own (one per event, appended), so that following a long job costs the same per poll at its end as at its
start; the `events` column of stores written before that is moved into them on open. One connection, guarded by
a lock, shared by the API handlers and the manager's background threads.

Every write that races with another request is a single conditional statement: `claim` admits a job only
if it is still waiting, `update` never changes a job that has ended, and metrics of a job deleted
meanwhile are dropped instead of breaking the writer.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainyard.actors.job_status import JobStatus

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    status TEXT NOT NULL,
    spec TEXT NOT NULL,
    steps INTEGER NOT NULL,
    step INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    actors TEXT NOT NULL DEFAULT '[]',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    event TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS metrics (
    job_id TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
    step INTEGER NOT NULL,
    row TEXT NOT NULL,
    PRIMARY KEY (job_id, step)
);
"""
# Columns added after the first release: a store written by an older service gains them on open.
_ADDED_COLUMNS = {
    "priority": "INTEGER NOT NULL DEFAULT 0",
    "needs": "TEXT NOT NULL DEFAULT '{}'",
    "admitted_at": "REAL",
    "ended_at": "REAL",
    "ranks": "TEXT NOT NULL DEFAULT '[]'",
    "events": "TEXT NOT NULL DEFAULT '[]'",
    "owner": "TEXT NOT NULL DEFAULT 'admin'",  # jobs stored before users belong to the admin (ADMIN)
}
_TERMINAL = ", ".join(f"'{s.value}'" for s in JobStatus if s.is_terminal)
_QUEUED = "status = 'PENDING' AND admitted_at IS NULL"
_QUEUE_ORDER = "priority DESC, created_at, rowid"
_LIVE = f"admitted_at IS NOT NULL AND status NOT IN ({_TERMINAL})"

ADMIN = "admin"
"""The user of the state directory's `token` (`trainyard serve`'s own), an admin: the owner of the jobs submitted with
it, and of those stored before jobs had owners."""


@dataclass
class JobRecord:
    job_id: str
    name: str
    status: JobStatus
    spec: dict
    steps: int
    step: int = 0
    error: str | None = None
    actors: list[str] = field(default_factory=list)
    created_at: float = 0.0
    updated_at: float = 0.0
    priority: int = 0
    needs: dict = field(default_factory=dict)
    """What the job needs from the cluster at once: {"bundle": {...}, "count": n} (see parallel.plan.Gang)."""
    admitted_at: float | None = None
    """When the admission loop reserved the job's resources; None while it waits in the queue."""
    ended_at: float | None = None
    ranks: list[dict] = field(default_factory=list)
    """Where each rank runs: rank, name, node, pid, device (once the workers have started)."""
    events: list[dict] = field(default_factory=list)
    """What happened to the job as it ran: failures, recoveries, checkpoints (see actors.coordinator)."""
    owner: str = ADMIN
    """The user who submitted it (`service.tenancy.users`)."""

    @property
    def queued(self) -> bool:
        return self.status is JobStatus.PENDING and self.admitted_at is None


class JobStore:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            have = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
            for column, decl in _ADDED_COLUMNS.items():
                if column not in have:
                    self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {decl}")
            for job_id, events in self._db.execute("SELECT job_id, events FROM jobs WHERE events != '[]'").fetchall():
                self._insert_events(job_id, json.loads(events), first=0)
                self._db.execute("UPDATE jobs SET events = '[]' WHERE job_id = ?", (job_id,))

    def _insert_events(self, job_id: str, events: list[dict], first: int | None = None) -> None:
        """Append events (numbered on from `first`, or after the job's last); the caller holds the lock."""
        if first is None:
            first = self._db.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM events WHERE job_id = ?",
                                     (job_id,)).fetchone()[0]
        self._db.executemany("INSERT OR REPLACE INTO events (job_id, seq, event) SELECT ?, ?, ? "
                             "WHERE EXISTS (SELECT 1 FROM jobs WHERE job_id = ?)",
                             [(job_id, first + i, json.dumps(e), job_id) for i, e in enumerate(events)])

    def _events(self, job_ids: list[str]) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {job_id: [] for job_id in job_ids}
        if len(job_ids) <= 900:  # SQLite's limit on parameters of one statement is far above
            marks = ", ".join("?" * len(job_ids))
            rows = self._db.execute(f"SELECT job_id, event FROM events WHERE job_id IN ({marks}) ORDER BY job_id, seq",
                                    job_ids)
        else:
            rows = self._db.execute("SELECT job_id, event FROM events ORDER BY job_id, seq")
        for job_id, event in rows:
            if job_id in out:
                out[job_id].append(json.loads(event))
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def insert(self, job: JobRecord) -> None:
        now = time.time()
        with self._lock:
            self._db.execute(
                f"INSERT INTO jobs ({_COLUMNS}) VALUES ({', '.join('?' * len(_COLUMN_LIST))})",
                (job.job_id, job.name, job.status.value, json.dumps(job.spec), job.steps, job.step, job.error,
                 json.dumps(job.actors), now, now, job.priority, json.dumps(job.needs), job.admitted_at,
                 job.ended_at, json.dumps(job.ranks), "[]", job.owner),
            )
            self._insert_events(job.job_id, job.events, first=0)

    def update(self, job_id: str, *, status: JobStatus | None = None, step: int | None = None,
               error: str | None = None, actors: list[str] | None = None, ranks: list[dict] | None = None,
               events: list[dict] | None = None) -> bool:
        """Set the given fields; True if the job changed. A terminal status is final: a late report (e.g. a
        poll answered just before a stop) changes neither the status nor the error of a job that has ended.
        `events` replaces the job's events (see `add_events` to append)."""
        now = time.time()
        sets, args = ["updated_at = ?"], list[object]([now])
        for column, value in (("status", status.value if status else None), ("step", step), ("error", error),
                              ("actors", json.dumps(actors) if actors is not None else None),
                              ("ranks", json.dumps(ranks) if ranks is not None else None)):
            if value is not None:
                sets.append(f"{column} = ?")
                args.append(value)
        if status is not None and status.is_terminal:
            sets.append("ended_at = ?")
            args.append(now)
        guard = f" AND status NOT IN ({_TERMINAL})" if status or error else ""
        with self._lock:
            cursor = self._db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE job_id = ?{guard}", (*args, job_id))
            if events is not None and cursor.rowcount > 0:
                self._db.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
                self._insert_events(job_id, events, first=0)
        return cursor.rowcount > 0

    def set_plan(self, job_id: str, spec: dict, needs: dict) -> bool:
        """A waiting job's layout chosen at last (`parallel: auto` submitted during a calibration): its spec with
        the layout, and what it needs from the cluster. False if it no longer waits (stopped or deleted)."""
        with self._lock:
            cursor = self._db.execute("UPDATE jobs SET spec = ?, needs = ?, updated_at = ? WHERE job_id = ? AND "
                                      "status = ? AND admitted_at IS NULL",
                                      (json.dumps(spec), json.dumps(needs), time.time(), job_id,
                                       JobStatus.PENDING.value))
        return cursor.rowcount > 0

    def add_events(self, job_id: str, events: list[dict]) -> None:
        """Append events to a job's (those of a job deleted meanwhile are dropped)."""
        if events:
            with self._lock:
                self._insert_events(job_id, events)

    def claim(self, job_id: str) -> bool:
        """Take a waiting job out of the queue (admitted now); False if it was stopped or deleted meanwhile."""
        now = time.time()
        with self._lock:
            cursor = self._db.execute(f"UPDATE jobs SET admitted_at = ?, updated_at = ? WHERE job_id = ? AND {_QUEUED}",
                                      (now, now, job_id))
        return cursor.rowcount > 0

    def interrupt(self, job_id: str, event: dict) -> None:
        """Put a job that was running when the service went down back into the queue, to go on from its latest
        checkpoint, and add `event` to its history. A job that has ended is left alone."""
        with self._lock:
            cursor = self._db.execute("UPDATE jobs SET status = ?, admitted_at = NULL, error = NULL, "
                                      f"updated_at = ? WHERE job_id = ? AND status NOT IN ({_TERMINAL})",
                                      (JobStatus.PENDING.value, time.time(), job_id))
            if cursor.rowcount > 0:
                self._insert_events(job_id, [event])

    def requeue(self, job_id: str, event: dict) -> None:
        """Put an admitted job that never started back into the queue (its resources were given back), and add
        `event` to its history."""
        with self._lock:
            cursor = self._db.execute("UPDATE jobs SET admitted_at = NULL, updated_at = ? WHERE job_id = ? AND "
                                      "status = ?", (time.time(), job_id, JobStatus.PENDING.value))
            if cursor.rowcount > 0:
                self._insert_events(job_id, [event])

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            events = self._events([job_id]) if row else {}
        return _record(row, events[job_id]) if row else None

    def list(self, owner: str | None = None) -> builtins.list[JobRecord]:
        """Every job, or `owner`'s."""
        where, args = ("WHERE owner = ?", (owner,)) if owner is not None else ("", ())
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY created_at, rowid", args).fetchall()
            events = self._events([r[0] for r in rows])
        return [_record(r, events[r[0]]) for r in rows]

    def queue(self) -> builtins.list[JobRecord]:
        """The waiting jobs in admission order."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE {_QUEUED} ORDER BY {_QUEUE_ORDER}").fetchall()
            events = self._events([r[0] for r in rows]) if rows else {}
        return [_record(r, events[r[0]]) for r in rows]

    def live_needs(self) -> builtins.list[tuple[str, str, dict]]:
        """(job_id, owner, what the job needs at once) of every admitted job that has not ended: what each user
        holds."""
        with self._lock:
            rows = self._db.execute(f"SELECT job_id, owner, needs FROM jobs WHERE {_LIVE}").fetchall()
        return [(job_id, owner, json.loads(needs)) for job_id, owner, needs in rows]

    def queued_count(self, owner: str | None = None) -> int:
        """Jobs waiting in the queue: every user's, or `owner`'s."""
        mine, args = (" AND owner = ?", (owner,)) if owner is not None else ("", ())
        with self._lock:
            return self._db.execute(f"SELECT COUNT(*) FROM jobs WHERE ({_QUEUED}){mine}", args).fetchone()[0]

    def delete(self, job_id: str) -> bool:
        """Delete an ended job and its metrics; False if there is no such job or it has not ended."""
        with self._lock:
            cursor = self._db.execute(f"DELETE FROM jobs WHERE job_id = ? AND status IN ({_TERMINAL})", (job_id,))
        return cursor.rowcount > 0

    def add_metrics(self, job_id: str, rows: builtins.list[dict]) -> None:
        """Store metrics rows; rows of a job that no longer exists (deleted meanwhile) are dropped."""
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO metrics (job_id, step, row) SELECT ?, ?, ? "
                "WHERE EXISTS (SELECT 1 FROM jobs WHERE job_id = ?)",
                [(job_id, r["step"], json.dumps(r), job_id) for r in rows],
            )

    def drop_metrics_from(self, job_id: str, step: int) -> None:
        """Forget the rows of steps >= `step` (a recovery rolled them back, and the job ended before running them
        again)."""
        with self._lock:
            self._db.execute("DELETE FROM metrics WHERE job_id = ? AND step >= ?", (job_id, step))

    def metrics(self, job_id: str, since: int = 0) -> builtins.list[dict]:
        with self._lock:
            rows = self._db.execute(
                "SELECT row FROM metrics WHERE job_id = ? AND step >= ? ORDER BY step", (job_id, since)
            ).fetchall()
        return [json.loads(r[0]) for r in rows]


_COLUMN_LIST = ("job_id", "name", "status", "spec", "steps", "step", "error", "actors", "created_at", "updated_at",
                "priority", "needs", "admitted_at", "ended_at", "ranks", "events", "owner")
_COLUMNS = ", ".join(_COLUMN_LIST)


def _record(row: tuple, events: list[dict]) -> JobRecord:
    (job_id, name, status, spec, steps, step, error, actors, created, updated, priority, needs, admitted_at,
     ended_at, ranks, _, owner) = row
    return JobRecord(job_id=job_id, name=name, status=JobStatus(status), spec=json.loads(spec), steps=steps,
                     step=step, error=error, actors=json.loads(actors), created_at=created, updated_at=updated,
                     priority=priority, needs=json.loads(needs), admitted_at=admitted_at, ended_at=ended_at,
                     ranks=json.loads(ranks), events=events, owner=owner)
