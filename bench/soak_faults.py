"""The faults of section `soak` (bench/soak.py): a seeded schedule, how each fault is done to the running soak
jobs, and, read back from the jobs' events at the end, whether and how fast each job it hit recovered.

Kinds: `kill_worker`, `hang_worker`, `kill_coordinator` (the service's fault drills, `POST /api/jobs/{id}/faults`,
on a running soak job, a rank drawn from the schedule's generator, two steps ahead), `service_sigkill` (the
`trainyard serve` process SIGKILLed and started again on the same state directory: its jobs, detached on the
joined cluster, train on and are reattached), `node_loss` (the second node of the two-node cluster removed, and
a new one added `NODE_DOWN_S` later: the jobs with ranks there wait for it, fault.node_grace_s, and resume).
Time to recover, per job hit: for a drill, the failure event's `waited_s` + the recovery's `recovery_s` (the
failed step's start, or a dead coordinator's last step, to the next finished step); for a node loss, the node's
removal to the job's next finished step (the node's time away included); for a service SIGKILL, the kill to the
job's next step seen through the new service.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from trainyard.cli.client import ApiError, Client

KINDS = ("kill_worker", "hang_worker", "kill_coordinator", "service_sigkill", "node_loss")
DRILLS = ("kill_worker", "hang_worker", "kill_coordinator")
EVERY = 10
"""The soak jobs' checkpoint.every."""
NODE_DOWN_S = 5.0
"""How long the second node stays away before a new one is added in its place."""


def schedule(seed: int, count: int) -> list[str]:
    """`count` fault kinds: each kind once in every run of len(KINDS), in an order drawn from `seed`."""
    rng, kinds = random.Random(seed), []
    while len(kinds) < count:
        batch = list(KINDS)
        rng.shuffle(batch)
        kinds += batch
    return kinds[:count]


@dataclass
class Fault:
    kind: str
    at: float
    """time.time() when it was done (a drill: asked for; it happens two steps later)."""
    jobs: list[str]
    """The soak jobs it hit (a node loss: those with a rank on the node)."""
    detail: str = ""
    recovery_s: dict[str, float] = field(default_factory=dict)
    """Job -> seconds to recover; a job hit that never recovered is missing."""
    unseen: list[str] = field(default_factory=list)
    """Jobs hit whose events show no failure for it (a drill the job ended before, or lost with its coordinator)."""

    def recovered(self) -> bool:
        return all(j in self.recovery_s or j in self.unseen for j in self.jobs)


def drill(client: Client, rng: random.Random, kind: str, running: dict[str, dict]) -> Fault | None:
    """The drill on a running soak job drawn by `rng`, of those not about to end (None: none runs)."""
    for job_id in rng.sample(sorted(running), len(running)):
        job = running[job_id]
        if job["step"] + 3 >= job["steps"] - 2:  # the drill would come after its last step (or its final save)
            continue
        rank = rng.randrange(max(1, len(job["ranks"]))) if kind != "kill_coordinator" else 0
        # Not a step that checkpoints: such a step is held to fault.step_timeout_s (300 s), not to the hang
        # detector's deadline, so a hang there takes minutes to notice (as bench/faults.py's AT_STEP avoids).
        at = job["step"] + 2 + ((job["step"] + 3) % EVERY == 0)
        try:
            client._call("POST", f"/api/jobs/{job_id}/faults", json={"kind": kind, "rank": rank, "at_step": at})
        except ApiError as e:
            if e.status_code == 409:  # it stopped running meanwhile
                continue
            raise
        return Fault(kind, time.time(), [job_id], f"{job['name']} rank {rank} at step {at}")
    return None


def node_loss(cluster: Any) -> Fault:
    """Remove the node that is not the head (the service's, where the coordinators run). The jobs it hit are
    those with a failure soon after (`evaluate`): a rank there may be running, starting or in a rendezvous."""
    head = cluster.head_node.node_id
    node = next(n for n in cluster.list_all_nodes() if n.node_id != head)
    cluster.remove_node(node)
    return Fault("node_loss", time.time(), [], f"node {node.node_id[:8]} removed")


CAUSES = {"kill_worker": "died", "hang_worker": "hung", "kill_coordinator": "coordinator died", "node_loss": "died"}
"""What the cause of a failure a fault made says."""
NODE_LOSS_NOTICED_S = NODE_DOWN_S + 10.0
"""A failure this long after a node's removal at most is the removal's (Ray notices a dead node within a second)."""


def evaluate(faults: list[Fault], events: dict[str, list[dict]], ended: dict[str, float]) -> set[tuple[str, int]]:
    """Fill in each drill's and node loss's `recovery_s` and `unseen` (a service SIGKILL is measured as it happens)
    from the jobs' events: each fault claims, in order, the first failure after it of the jobs it hit whose cause
    is its kind's and that no fault before claimed; the job recovered at its next `recovered` event, or, if none
    came and it SUCCEEDED (`ended`: job -> its end), at its end (a failure in its final checkpoint or export
    recovers with no step left to finish, so with no `recovered` event). Time to
    recover: a drill, from the failed step's start (the failure's time less its `waited_s`); a node loss, from
    the removal. Returns the failures claimed, as (job, failure number)."""
    claimed: set[tuple[str, int]] = set()
    for fault in faults:
        if fault.kind == "service_sigkill":
            continue
        if fault.kind == "node_loss":
            fault.jobs = sorted(j for j, evs in events.items() if any(
                e["kind"] in ("failure", "node_lost") and fault.at - 1.0 <= e["time"] <= fault.at + NODE_LOSS_NOTICED_S
                for e in evs))
        for job_id in fault.jobs:
            failure = next((e for e in events[job_id] if e["kind"] == "failure" and e["time"] >= fault.at - 1.0
                            and CAUSES[fault.kind] in e["cause"] and (job_id, e["failure"]) not in claimed), None)
            if failure is None:
                fault.unseen.append(job_id)
                continue
            claimed.add((job_id, failure["failure"]))
            recovered = next((e for e in events[job_id] if e["kind"] == "recovered" and e["time"] >= failure["time"]),
                             None)
            at = recovered["time"] if recovered is not None else ended.get(job_id)
            if at is not None:
                began = fault.at if fault.kind == "node_loss" else failure["time"] - failure["waited_s"]
                fault.recovery_s[job_id] = at - began
    return claimed


def unplanned(claimed: set[tuple[str, int]], events: dict[str, list[dict]]) -> list[str]:
    """Failures of soak jobs that no fault claimed (a slow step taken for a hang, say): 'job: cause'."""
    return [f"{job_id}: {e['cause'].splitlines()[0]}" for job_id, evs in events.items() for e in evs
            if e["kind"] == "failure" and (job_id, e["failure"]) not in claimed]
