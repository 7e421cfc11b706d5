"""Following a job: how far the service has read a coordinator's reports (`Cursor`), and writing a report
to the store (`apply_report`). A poll asks only for what is new (metrics from the next step, events from the
cursor), so its cost does not grow with the job's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.actors.state import JobStatus
from trainyard.service.store import JobStore


@dataclass
class Cursor:
    """How far the service has followed a job: the next step's metrics, and the events it holds of the
    coordinator's list (`incarnation`: which list; None: ask for the whole list)."""

    step: int
    events: int = 0
    incarnation: str | None = None


def apply_report(store: JobStore, job_id: str, report: dict, cursor: Cursor) -> JobStatus:
    """Write a coordinator's report to the store: the new metrics rows, the new events (the whole list when the
    report holds it: the first poll of a coordinator, or a final report), status and progress; move the job's
    cursor. The work is that of what is new, whatever the job's length."""
    if report["metrics"]:
        store.add_metrics(job_id, report["metrics"])
    start, events, incarnation = report.get("events_from"), report["events"], report.get("incarnation")
    whole = None
    if start is None:
        whole, cursor.events, cursor.incarnation = events, len(events), incarnation
    elif incarnation == cursor.incarnation and start == cursor.events:
        store.add_events(job_id, events)
        cursor.events += len(events)
    else:  # Ray restarted the coordinator since: its list is another; ask for all of it next time
        cursor.incarnation = None
    status = JobStatus(report["status"])
    if status is JobStatus.STOPPED:
        # Stopped during a recovery from a checkpoint: the rows after it belong to the attempt the recovery rolled
        # back; the job's step, final checkpoint and model are at the checkpoint's step.
        store.drop_metrics_from(job_id, report["step"])
    store.update(job_id, status=status, step=report["step"], error=report["error"], actors=report["actors"],
                 ranks=report["ranks"], events=whole)
    cursor.step = report["step"]
    return status
