"""What a coordinator leaves beside the checkpoints for the next incarnation of itself (Ray restarts a
coordinator whose process died): its events and failure causes, and one metrics row per step.

Both files are append-only, one JSON object a line, so that a write costs the same at step 100,000 as at
step 10 (the journal was once rewritten whole at each checkpoint). A line cut short by a crash is skipped
on reading. `coordinator.json`, the whole-file journal of earlier versions, is still read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("trainyard.coordinator")

JOURNAL, OLD_JOURNAL, METRICS_LOG = "journal.jsonl", "coordinator.json", "metrics.jsonl"


def _lines(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _append(path: Path, record: dict) -> int:
    """Append one line; returns the bytes written."""
    return AppendOnly(path).append(record)


class AppendOnly:
    """A JSON-lines file appended to. Lines a full disk (or any write error) refused wait in memory and go out
    with the next append that succeeds, in order: the coordinator never dies of its own bookkeeping (its
    checkpoints' file system may be full while the job trains on). A write cut short by the error leaves a torn
    line, which readers skip; the retry starts on a line of its own."""

    def __init__(self, path: Path):
        self.path = path
        self.pending: list[str] = []
        self.torn = False

    def append(self, record: dict) -> int:
        """Append `record` (and any lines still pending); the bytes written, 0 while the file refuses them."""
        self.pending.append(json.dumps(record) + "\n")
        text = ("\n" if self.torn else "") + "".join(self.pending)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(text)
        except OSError as e:
            if not self.torn:
                log.warning("%s refused a write (%s): %d lines wait in memory for the next append", self.path, e,
                            len(self.pending))
            self.torn = True
            return 0
        self.pending, self.torn = [], False
        return len(text)


def merge_events(*lists: list[dict]) -> list[dict]:
    """The events of every list, each once, oldest first."""
    unique = {(e["time"], e["kind"]): e for events in lists for e in events}
    return [unique[key] for key in sorted(unique)]


class Journal:
    """The job's events (failures, recoveries, checkpoints, resizes; GET /api/jobs/{id}/events) and the
    causes of the failures counted against `fault.max_failures`, in memory and appended to the file."""

    def __init__(self, root: Path, known: list[dict], restarted: bool):
        """`known`: the events the service had when it started this coordinator; `restarted`: Ray restarted
        it, and it goes on counting the causes its predecessor recorded since the job was (re)launched."""
        self.root = root
        self.file = AppendOnly(root / JOURNAL)
        old = {}
        try:
            old = json.loads((root / OLD_JOURNAL).read_text())
        except (OSError, ValueError):
            pass
        lines = _lines(root / JOURNAL)
        written = [r["event"] for r in lines if "event" in r]
        self.events = merge_events(known, old.get("events", []), written)
        self.bytes_written = 0
        """What this incarnation appended (the poll-cost test reads it)."""
        self.causes: list[str] = []
        if restarted:
            launched = max((i for i, r in enumerate(lines) if "launch" in r), default=-1)
            self.causes = old.get("causes", []) if launched < 0 else []
            self.causes += [r["cause"] for r in lines[launched + 1:] if "cause" in r]
        else:
            self.bytes_written += self.file.append({"launch": True})

    def add_event(self, event: dict) -> None:
        self.events.append(event)
        self.bytes_written += self.file.append({"event": event})

    def add_cause(self, cause: str) -> None:
        self.causes.append(cause)
        self.bytes_written += self.file.append({"cause": cause})

    def all_causes(self) -> str:
        return all_causes(self.causes)


def all_causes(causes: list[str] | tuple[str, ...]) -> str:
    if len(causes) == 1:
        return causes[0]
    return "\n".join(f"failure {i} of {len(causes)}: {cause}" for i, cause in enumerate(causes, 1))


def append_metrics_log(root: Path, row: dict) -> int:
    return _append(root / METRICS_LOG, row)


def read_metrics_log(root: Path) -> list[dict]:
    """The last row written for each step, in step order (a step run again after a recovery wrote it again)."""
    rows = {row["step"]: row for row in _lines(root / METRICS_LOG)}
    return [rows[step] for step in sorted(rows)]


def steps_logged(root: Path) -> int | None:
    """One past the last step whose row the metrics log holds (None: no row yet): the latest checkpoint a job may
    go on from. A checkpoint after it is committed by the ranks during a step, before the coordinator appends that
    step's row; a process killed in between (the service's embedded Ray under SIGKILL, a coordinator's death)
    leaves a checkpoint ahead of the rows, and going on from it would lose the rows in between for good. Going on
    from an earlier one trains those steps again, to the same numbers, and writes their rows."""
    steps = [row["step"] for row in _lines(root / METRICS_LOG)]
    return max(steps) + 1 if steps else None


def mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
