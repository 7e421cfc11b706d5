"""(All in `make test-slow`.) A two-node Ray cluster (`ray.cluster_utils.Cluster`, fake GPUs) that `trainyard serve
--ray-address` joins: each tensor-parallel group lands on one node and a (pp=2, tp=2) job spans both nodes; then nodes
are lost under running jobs: an elastic job shrinks to the replica left and trains on, a fixed-size one waits for a node
added back and resumes (both in `make test-slow`, beside tests/e2e/test_elastic_cluster.py's shrink-and-grow-back
story), and a fixed-size one whose node does not come back fails naming it (the short node-loss check in `make test`).
The tests that remove a node run last; each one adds a second node back first if it is missing."""

from __future__ import annotations

import os

import pytest
from helpers import SLOW, tiny_spec, wait_for, wait_terminal
from test_serve_process import start_serve

pytestmark = SLOW  # two Ray nodes and their jobs: about 40 s of make test's budget


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"  # tests only: the product keeps Ray's token auth on
    # 4 CPUs and 2 (fake) GPUs per node: a pp=2 x tp=2 job needs 2 bundles of 2 CPU + 2 GPU, so one fits on a
    # node and the job must use both.
    # Ray notices a lost node after two missed health checks half a second apart (not tens of seconds).
    fast_health_checks = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False,
                                      "object_store_memory": 100 * 2**20, "_system_config": fast_health_checks})
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def serve(two_node_cluster, tmp_path_factory):
    where = tmp_path_factory.mktemp("serve")
    proc, client = start_serve(where / "state", where / "serve.log", ray_address=two_node_cluster.address)
    yield client
    client.close()
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def test_a_job_is_placed_across_two_nodes_with_each_tp_group_on_one(serve):
    client = serve
    cluster = client.cluster()
    assert cluster["nodes"] == 2 and cluster["gpus"] == 4
    spec = tiny_spec(steps=2, model={"n_layer": 4}, parallel={"pp": 2, "tp": 2, "microbatches": 2})
    plan = client.plan(spec)
    assert plan["resources"]["bundles"] == [{"CPU": 2.0, "GPU": 2.0}] * 2
    job = wait_terminal(client, client.submit(spec), timeout_s=300)
    assert job["status"] == "SUCCEEDED", job["error"]
    node_of = {r["rank"]: r["node_id"] for r in job["ranks"]}
    assert len(node_of) == 4 and len(set(node_of.values())) == 2
    for group in plan["groups"]["tp"]:
        assert len({node_of[r] for r in group}) == 1, f"tp group {group} spans nodes"
    assert all(r["device"] == "cpu" for r in job["ranks"])  # fake GPUs: gloo on CPU, the GPU code path


NODE = {"num_cpus": 4, "num_gpus": 2, "object_store_memory": 100 * 2**20}


def _second_node(cluster):
    """The node that is not the head (the service's node, where the coordinators run): one is added if a test
    before removed it."""
    if len(cluster.list_all_nodes()) < 2:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
    head = cluster.head_node.node_id
    return next(n for n in cluster.list_all_nodes() if n.node_id != head)


def _events(client, job_id: str, kind: str) -> list[dict]:
    return [e for e in client.events(job_id) if e["kind"] == kind]


def _replicas_on(client, job_id: str, node_id: str) -> list[int]:
    """The data-parallel replicas (pp = tp = 1: the ranks) on that node (Ray packs a job's bundles on either)."""
    return sorted(r["rank"] for r in client.job(job_id)["ranks"] if r["node_id"] == node_id)


def _resizes(client, job_id: str) -> list[tuple[int, int, str]]:
    return [(e["from"]["dp"], e["to"]["dp"], e["reason"]) for e in client.events(job_id) if e["kind"] == "resize"]


def test_an_elastic_job_that_loses_a_node_shrinks_to_the_replica_left_and_trains_on(serve, two_node_cluster):
    """It removes the second node. Slow (about 90 s on two busy cores), so `make test-slow` runs it, not `make
    test`. The shrink once never came: the coordinator, placed by a soft affinity to the service's node, had
    landed on the removed node and died with it (it is pinned to the service's node now)."""
    client, cluster = serve, two_node_cluster
    _second_node(cluster)
    # A rank needs a whole node's 4 CPUs: dp=2 puts one replica on each node.
    spec = tiny_spec(steps=100_000, global_batch=8, name="node-loss", resources={"cpus_per_worker": 4},
                     parallel={"dp": {"min": 1, "max": 2}, "microbatches": 2}, checkpoint={"every": 2},
                     fault={"node_grace_s": 1, "grow_interval_s": 1})
    job_id = client.submit(spec)
    try:
        # it starts at dp=1 and grows into the second node
        wait_for(lambda: (1, 2, "resources appeared") in _resizes(client, job_id), 300, "the job to grow to dp=2")
        grown = wait_for(lambda: (j := client.job(job_id))["status"] == "RUNNING" and len(j["ranks"]) == 2 and j,
                         300, "the job to run at dp=2")
        wait_for(lambda: client.job(job_id)["step"] > grown["step"], 300, "a step at dp=2")
        head = cluster.head_node.node_id
        worker_node = _second_node(cluster)
        on_it = _replicas_on(client, job_id, worker_node.node_id)
        assert len(on_it) == 1
        cluster.remove_node(worker_node)
        wait_for(lambda: (2, 1, "node lost") in _resizes(client, job_id), 300, "the job to shrink to dp=1")
        [lost_event] = _events(client, job_id, "node_lost")
        assert worker_node.node_id in lost_event["nodes"] and lost_event["replicas"] == on_it
        lost = next(e for e in client.events(job_id) if e["kind"] == "resize" and e["reason"] == "node lost")
        assert lost["moved"] == "checkpoint" and lost["paused_s"] > 0
        failure = next(e for e in client.events(job_id) if e["kind"] == "failure")
        step = wait_for(lambda: (j := client.job(job_id))["status"] == "RUNNING" and j["step"], 300,
                        "the job to run again")
        wait_for(lambda: client.job(job_id)["step"] >= step + 2, 300, "two more steps at dp=1")
        job = client.job(job_id)
        assert job["status"] == "RUNNING" and [r["node_id"] for r in job["ranks"]] == [head]
        assert failure["restore_step"] % 2 == 0  # the latest checkpoint (every 2 steps)
        rows = client.metrics(job_id)
        assert [r["step"] for r in rows] == list(range(len(rows)))  # no step lost or counted twice
    finally:
        client.stop(job_id)


def test_a_fixed_size_job_that_loses_a_node_waits_for_one_added_back_and_resumes(serve, two_node_cluster):
    """A fixed-size dp=2 job, one rank on each node: the worker node is removed, the job waits (RECOVERING, a
    `node_lost` event) within fault.node_grace_s, a new node is added, Ray places the lost bundle on it and the
    job resumes (from the live replica on the head node) and ends SUCCEEDED with no step lost or counted twice."""
    client, cluster = serve, two_node_cluster
    spec = tiny_spec(steps=30, global_batch=8, name="fixed-node-loss", resources={"cpus_per_worker": 4},
                     parallel={"dp": 2, "microbatches": 2}, checkpoint={"every": 2}, fault={"node_grace_s": 300})
    job_id, lost_node, on_it = _run_then_lose_the_second_node(client, cluster, spec, steps=2)
    wait_for(lambda: _events(client, job_id, "node_lost"), 120, "the job to wait for the lost node")
    assert client.job(job_id)["status"] == "RECOVERING"
    cluster.add_node(**NODE)
    job = wait_terminal(client, job_id, timeout_s=300)
    assert job["status"] == "SUCCEEDED", job["error"]
    [lost] = _events(client, job_id, "node_lost")
    assert lost_node.node_id in lost["nodes"] and lost["replicas"] == on_it
    [failure] = _events(client, job_id, "failure")
    assert failure["recovered_from"] in ("replica", "checkpoint"), failure
    assert len({r["node_id"] for r in job["ranks"]} - {lost_node.node_id}) == 2  # the head and the new node
    assert [r["step"] for r in client.metrics(job_id)] == list(range(30))


def test_a_fixed_size_job_whose_node_does_not_come_back_fails_naming_it(serve, two_node_cluster):
    """The short node-loss check `make test` runs (last in this file: it removes the second node): a fixed-size
    dp=2 job, a rank on each node, with fault.node_grace_s=0 fails at once when the worker node is removed, the
    error and a `node_lost` event naming the node."""
    client, cluster = serve, two_node_cluster
    spec = tiny_spec(steps=100_000, global_batch=8, name="lost-for-good", resources={"cpus_per_worker": 4},
                     parallel={"dp": 2, "microbatches": 2}, fault={"node_grace_s": 0})
    job_id, lost_node, on_it = _run_then_lose_the_second_node(client, cluster, spec, steps=1)
    job = wait_terminal(client, job_id, timeout_s=120)
    assert job["status"] == "FAILED"
    assert lost_node.node_id in job["error"] and "fault.node_grace_s=0 s" in job["error"], job["error"]
    [lost] = _events(client, job_id, "node_lost")
    assert lost_node.node_id in lost["nodes"] and lost["replicas"] == on_it


def _run_then_lose_the_second_node(client, cluster, spec: dict, steps: int):
    """Submit a dp=2 job, wait for `steps` steps, check one replica sits on the second node and remove that node:
    (job id, the removed node, the replicas that were on it)."""
    lost_node = _second_node(cluster)
    job_id = client.submit(spec)
    wait_for(lambda: (j := client.job(job_id))["status"] == "RUNNING" and j["step"] >= steps, 300,
             f"{steps} step(s) at dp=2")
    on_it = _replicas_on(client, job_id, lost_node.node_id)
    assert len(on_it) == 1
    cluster.remove_node(lost_node)
    return job_id, lost_node, on_it
