"""Calling every rank at once and blaming the right ones when a call fails.

`call_all` awaits one call per rank; the first failure (or the deadline) raises `StepFailed`, which says
which ranks died, raised, or never answered. When a rank's process dies its peers' collectives fail too,
often before Ray reports the death, so after a first failure it waits a moment (`DEATH_GRACE_S`) for a death
to show: the error then names the rank that died, not the first peer that noticed.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import ray
from trainyard.parallel.plan import Plan

OUT_OF_MEMORY_SIGNS = ("running low on memory", "OutOfMemoryError", "can't allocate memory", "Cannot allocate memory",
                       "MemoryError")
"""What an error says when its rank ran out of memory: Ray's memory monitor killed it ("Task was killed due to
the node running low on memory"), torch's allocator refused it (CPU: "can't allocate memory"; CUDA:
"torch.OutOfMemoryError: CUDA out of memory"), or Python raised MemoryError. Not a bare "out of memory": Ray's
message for any worker that died lists it among the possible causes."""

DEATH_GRACE_S = 5.0
"""After a rank fails, how long to wait for the other ranks' results of the same call, so that a rank
whose process died is found among them (Ray reports a death a moment after the peers see broken pipes)."""


class StepFailed(RuntimeError):
    """A call that failed on some ranks: which ones died, raised, or never answered (hung or blocked)."""

    def __init__(self, message: str, *, dead: tuple[int, ...] = (), raised: tuple[int, ...] = (),
                 pending: tuple[int, ...] = (), blamed: tuple[int, ...] = (), answered: tuple[object, ...] = (),
                 out_of_memory: tuple[int, ...] = (), deaths: tuple[tuple[int, str], ...] = ()):
        super().__init__(message)
        self.dead, self.raised, self.pending, self.blamed = dead, raised, pending, blamed
        self.out_of_memory = out_of_memory
        """The blamed ranks that ran out of memory (`out_of_memory`)."""
        self.deaths = deaths
        """Ray's word for each rank that died: (rank, its error's text)."""
        self.answered = answered
        """What the ranks that did finish the call returned."""


class Unrecoverable(RuntimeError):
    """The job cannot go on whatever its failure budget (e.g. an elastic job below its minimum size)."""


@dataclass(frozen=True)
class Failure:
    """A failure as the states carry it: its cause and the ranks it concerns (none: the coordinator died)."""

    cause: str
    blamed: tuple[int, ...] = ()
    dead: tuple[int, ...] = ()
    raised: tuple[int, ...] = ()
    pending: tuple[int, ...] = ()
    failed_at: float = 0.0
    waited_s: float = 0.0
    """How long the failed call had run."""
    step: int = 0
    """The step the job was at."""
    coordinator: bool = False
    """The coordinator's own process died: every rank died with it."""
    answered: tuple[object, ...] = ()
    """The results of the ranks that finished the failed call (a step's call: each rank's list of the `StepReport`s
    of the steps whose figures it returned, `Worker.run_step`)."""
    out_of_memory: tuple[int, ...] = ()
    """The blamed ranks that ran out of memory: the same layout would again, so it is not retried."""
    deaths: tuple[tuple[int, str], ...] = ()
    """Ray's word for each rank that died (`oom_killer.oom_killed` reads it)."""

    @classmethod
    def of(cls, error: StepFailed, step: int, call_began: float) -> Failure:
        now = time.time()
        return cls(cause=str(error), blamed=error.blamed, dead=error.dead, raised=error.raised,
                   pending=error.pending, failed_at=now, waited_s=now - call_began, step=step,
                   answered=error.answered, out_of_memory=error.out_of_memory, deaths=error.deaths)

    @property
    def reusable(self) -> set[int]:
        """Ranks that raised but are alive and answering: reset and reused, not replaced."""
        return set(self.raised) - set(self.dead) - set(self.pending)


async def call_all(refs: list, what: str, timeout: float, plan: Plan, ranks: list[dict], hang: bool = False,
                   next_calls: list | None = None) -> list:
    """Await one call per worker; the first failure (or the timeout) raises StepFailed. `hang`: the timeout is
    the hang policy's, and the message says so. `next_calls`: the calls queued after these; a rank that
    answered and then died (its peers failing on it while they finish) shows as their failure, and is blamed."""
    tasks = {asyncio.ensure_future(ref): rank for rank, ref in enumerate(refs)}
    done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
    # After a first failure, wait a moment for a rank's death to be reported (its peers' errors often come
    # first), but no longer once a death is known: the ranks still running are then blocked on it.
    grace_end = time.monotonic() + DEATH_GRACE_S
    while pending and any(t.exception() is not None for t in done) and not any(
            isinstance(t.exception(), ray.exceptions.RayActorError) for t in done):
        more, pending = await asyncio.wait(pending, timeout=max(0.0, grace_end - time.monotonic()),
                                           return_when=asyncio.FIRST_EXCEPTION)
        done |= more
        if not more:
            break
    for task in pending:
        task.cancel()
    failures = {tasks[t]: t.exception() for t in done if t.exception() is not None}
    if failures and next_calls and not any(isinstance(e, ray.exceptions.RayActorError) for e in failures.values()):
        later = {asyncio.ensure_future(ref): rank for rank, ref in enumerate(next_calls)}
        finished, unfinished = await asyncio.wait(later, timeout=max(0.0, grace_end - time.monotonic()),
                                                  return_when=asyncio.FIRST_EXCEPTION)
        for task in unfinished:
            task.cancel()
        failures |= {later[t]: t.exception() for t in finished
                     if isinstance(t.exception(), ray.exceptions.RayActorError)}
    late = tuple(sorted(tasks[t] for t in pending))
    if failures:
        dead = tuple(sorted(r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError)))
        raised = tuple(sorted(set(failures) - set(dead)))
        answered = tuple(t.result() for t in done if t.exception() is None)
        blamed = dead or raised[:1]
        raise StepFailed(describe_failure(failures, what, plan, ranks), dead=dead, raised=raised, pending=late,
                         blamed=blamed, answered=answered,
                         out_of_memory=tuple(r for r in blamed if out_of_memory(failures[r])),
                         deaths=tuple((r, str(failures[r])) for r in dead))
    if pending:
        rule = ("fault.hang_factor x the median recent step, at least fault.hang_floor_s" if hang and
                timeout < plan.config.fault.step_timeout_s else "fault.step_timeout_s")
        raise StepFailed(f"{what} hung: no answer after {timeout:.3g} s ({rule}); ranks still running: "
                         f"{list(late)}", pending=late, blamed=late)
    return [task.result() for task in tasks]


def describe_failure(failures: dict[int, BaseException], what: str, plan: Plan, ranks: list[dict]) -> str:
    """Blame the ranks whose process died if any did (their peers' errors are consequences), else the lowest
    rank that raised."""
    dead = sorted(r for r, e in failures.items() if isinstance(e, ray.exceptions.RayActorError))
    if dead:
        lines = [f"rank {r} ({plan.worker_name(r)}) died in {what}: its process exited "
                 f"({_death_cause(failures[r], ranks[r] if r < len(ranks) else {})})" for r in dead]
        others = sorted(set(failures) - set(dead))
        if others:
            lines.append(f"ranks {others} then failed talking to it (not a cause)")
        return "\n".join(lines)
    rank = min(failures)
    return f"rank {rank} ({plan.worker_name(rank)}) failed in {what}:\n{_remote_traceback(failures[rank])}"


def out_of_memory(error: BaseException) -> bool:
    """Whether a rank's error says it ran out of memory (`OUT_OF_MEMORY_SIGNS`)."""
    if isinstance(error, MemoryError | ray.exceptions.OutOfMemoryError):
        return True
    cause = getattr(error, "cause", None)  # a RayTaskError carries the rank's own exception
    if isinstance(cause, MemoryError) or type(cause).__name__ == "OutOfMemoryError":
        return True
    return any(sign in str(error) for sign in OUT_OF_MEMORY_SIGNS)


def first_line(error: BaseException) -> str:
    """An error's first line (its type's name when it says nothing)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def own_error(error: BaseException, doing: str) -> str:
    """A job's error when the coordinator's own code raised (not a rank's: no user code ran there), in one sentence:
    what it was doing and the error's type and first line. Its traceback is the coordinator's, for its log: a user
    can act on neither."""
    return (f"the job's coordinator failed {doing} (an error in trainyard, not in a rank): {type(error).__name__}: "
            f"{first_line(error)} (the traceback is in the coordinator's log)")


def _death_cause(error: BaseException, info: dict) -> str:
    where = f"pid {info['pid']} on node {info['node']}; " if info else ""
    return f"{where}Ray: {first_line(error)}"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _remote_traceback(error: BaseException) -> str:
    """The worker's own traceback when Ray carried one, without terminal colour codes."""
    if not isinstance(error, ray.exceptions.RayTaskError):  # e.g. the actor died: no Python traceback
        return str(error)
    return "Traceback (most recent call last), from " + _ANSI.sub("", str(error)).strip()
