"""The job store: SQLite (WAL) in the state directory, the service's only durable state.

It holds each job's spec, status, progress and error, and one metrics row per finished step, so that a
restarted service still lists every job and its curve. One connection, guarded by a lock, shared by the
API handlers and the manager's follower thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from actors.state import JobStatus

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
CREATE TABLE IF NOT EXISTS metrics (
    job_id TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
    step INTEGER NOT NULL,
    row TEXT NOT NULL,
    PRIMARY KEY (job_id, step)
);
"""


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


class JobStore:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def insert(self, job: JobRecord) -> None:
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (job_id, name, status, spec, steps, step, error, actors, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job.job_id, job.name, job.status.value, json.dumps(job.spec), job.steps, job.step, job.error,
                 json.dumps(job.actors), now, now),
            )

    def update(self, job_id: str, *, status: JobStatus | None = None, step: int | None = None,
               error: str | None = None, actors: list[str] | None = None) -> None:
        sets, args = ["updated_at = ?"], [time.time()]
        for column, value in (("status", status.value if status else None), ("step", step), ("error", error),
                              ("actors", json.dumps(actors) if actors is not None else None)):
            if value is not None:
                sets.append(f"{column} = ?")
                args.append(value)
        # A terminal status is final: a late report (e.g. a poll answered just before a stop) changes
        # neither the status nor the error of a job that has ended.
        terminal = ", ".join(f"'{s.value}'" for s in JobStatus if s.is_terminal)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE job_id = ?"
                             + (f" AND status NOT IN ({terminal})" if status or error else ""), (*args, job_id))

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return _record(row) if row else None

    def list(self) -> list[JobRecord]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM jobs ORDER BY created_at").fetchall()
        return [_record(r) for r in rows]

    def delete(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))

    def add_metrics(self, job_id: str, rows: list[dict]) -> None:
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO metrics (job_id, step, row) VALUES (?, ?, ?)",
                [(job_id, r["step"], json.dumps(r)) for r in rows],
            )

    def metrics(self, job_id: str, since: int = 0) -> list[dict]:
        with self._lock:
            rows = self._db.execute(
                "SELECT row FROM metrics WHERE job_id = ? AND step >= ? ORDER BY step", (job_id, since)
            ).fetchall()
        return [json.loads(r[0]) for r in rows]


_COLUMNS = "job_id, name, status, spec, steps, step, error, actors, created_at, updated_at"


def _record(row: tuple) -> JobRecord:
    job_id, name, status, spec, steps, step, error, actors, created, updated = row
    return JobRecord(job_id=job_id, name=name, status=JobStatus(status), spec=json.loads(spec), steps=steps,
                     step=step, error=error, actors=json.loads(actors), created_at=created, updated_at=updated)
