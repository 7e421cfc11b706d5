"""The checks of section `soak` (bench/soak.py) besides the losses: the burst of queued submits from several users
in the middle of the soak, the store against Ray (every job the store shows running has its coordinator, and no
coordinator runs for a job the store shows ended or does not hold), and what is left behind at the end (Ray actors,
placement groups, processes).

The burst: each user (one per soak layout, whose quota is exactly what their soak job holds) submits its share
of `count` tiny one-rank jobs at priority -1 from 16 client threads; the user's quota holds them in the queue
while their soak job runs (they do not hold the queue: the other users' soak jobs are admitted past them). Every
submit must be answered 201; then each user lists only their own jobs, another user's job is a 403, the admin
lists all of them with their owners; then their owners stop and delete them all.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
from trainyard.actors.naming import NAMESPACE, coordinator_name
from trainyard.cli.client import ApiError, Client
from trainyard.service.ray_runtime import descendants

BURST_CLIENTS = 16
NOT_LIVE = ("PENDING", "SUCCEEDED", "FAILED", "STOPPED")


@dataclass
class Burst:
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    """Anything that went wrong: a submit not answered 201, a job missing or another user's job shown."""
    answered: int = 0
    cleaned_s: float = 0.0


def burst(url: str, tokens: dict[str, str], admin: Client, count: int, spec: dict) -> Burst:
    """`count` submits spread over the users of `tokens` (name -> token); checked and cleaned up as the module
    docstring says."""
    out, local = Burst(), threading.local()
    names = sorted(tokens)
    lock = threading.Lock()

    def client(user: str) -> Client:
        clients = local.__dict__.setdefault("clients", {})
        return clients.setdefault(user, Client(url, tokens[user]))

    def submit(i: int) -> tuple[str, str] | None:
        user = names[i % len(names)]
        start = time.perf_counter()
        try:
            job_id = client(user).submit({**spec, "name": f"burst-{i}"})
        except Exception as e:  # noqa: BLE001 - every failure is a finding, reported
            with lock:
                out.problems.append(f"submit {i} by {user}: {e}")
            return None
        with lock:
            out.latencies.append(time.perf_counter() - start)
        return user, job_id

    start = time.perf_counter()
    with ThreadPoolExecutor(BURST_CLIENTS) as pool:
        submitted = [s for s in pool.map(submit, range(count)) if s is not None]
    out.wall_s, out.answered = time.perf_counter() - start, len(submitted)
    owners = {job_id: user for user, job_id in submitted}
    listed = {j["job_id"]: j["owner"] for j in admin.jobs()}
    out.problems += [f"job {j} of {u}: listed as {listed.get(j)!r}" for j, u in owners.items() if listed.get(j) != u]
    for user in names:
        theirs = {j["owner"] for j in client(user).jobs()}
        if theirs - {user}:
            out.problems.append(f"{user} lists jobs of {sorted(theirs - {user})}")
    other = next((j for j, u in owners.items() if u != names[0]), None)
    if other is not None:
        try:
            client(names[0]).job(other)
            out.problems.append(f"{names[0]} read {owners[other]}'s job {other}")
        except ApiError as e:
            if e.status_code != 403:
                out.problems.append(f"{names[0]} reading {owners[other]}'s job: {e.status_code}, not 403")

    def clean(pair: tuple[str, str]) -> None:
        user, job_id = pair
        try:
            client(user).stop(job_id)
            client(user).delete(job_id)
        except Exception as e:  # noqa: BLE001 - reported
            with lock:
                out.problems.append(f"stop/delete {job_id} by {user}: {e}")

    start = time.perf_counter()
    with ThreadPoolExecutor(BURST_CLIENTS) as pool:
        list(pool.map(clean, submitted))
    out.cleaned_s = time.perf_counter() - start
    left = set(owners) & {j["job_id"] for j in admin.jobs()}
    if left:
        out.problems.append(f"{len(left)} burst jobs still listed after their deletion")
    return out


def p99(values: Iterable[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(0.99 * len(ordered)) - 1)] if ordered else float("nan")


def p50(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def trainyard_actors() -> set[str]:
    """The live named Ray actors of trainyard (coordinators and ranks, `trainyard/<job>/...`)."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith("trainyard/")}


def live_placement_groups() -> list[str]:
    return sorted(e["name"] or pg_id for pg_id, e in ray.util.placement_group_table().items()
                  if e["state"] != "REMOVED")


def store_vs_ray(jobs: list[dict]) -> list[str]:
    """Where the store (the jobs as the API lists them) and Ray disagree, once: a job shown running without its
    coordinator, a coordinator of a job shown ended, waiting or unknown."""
    actors = trainyard_actors()
    live = {j["job_id"] for j in jobs if j["status"] not in NOT_LIVE}
    problems = [f"job {j} is {s} in the store but has no coordinator" for j, s in
                ((j["job_id"], j["status"]) for j in jobs if j["job_id"] in live)
                if coordinator_name(j) not in actors]
    known = {j["job_id"]: j["status"] for j in jobs}
    for name in sorted(a for a in actors if a.endswith("/coordinator")):
        job_id = name.split("/")[1]
        if job_id not in live:
            problems.append(f"coordinator {name} runs for a job the store shows {known.get(job_id, 'nowhere')}")
    return problems


def settled(check: Callable[[], list[str]], timeout_s: float = 20.0) -> list[str]:
    """`check`'s problems once they persist: a job that ends between the list and Ray's answer is not one (the
    service removes an ended job's coordinator on its next poll); [] as soon as a check finds none."""
    deadline = time.monotonic() + timeout_s
    while (problems := check()) and time.monotonic() < deadline:
        time.sleep(1.0)
    return problems


def processes_left(pid: int) -> list[int]:
    """Live (not zombie) descendants of `pid`."""
    def alive(p: int) -> bool:
        try:
            with open(f"/proc/{p}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    return [p for p in descendants(pid) if alive(p)]
