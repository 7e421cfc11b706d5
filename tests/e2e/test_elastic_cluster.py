"""Automatic elasticity on a two-node Ray cluster (`ray.cluster_utils.Cluster`) that `trainyard serve
--ray-address` joins: a job with parallel.dp = {min: 1, max: 4} starts at dp=1, grows into the free
resources, shrinks when a node is removed (its bundles cannot be placed again within fault.node_grace_s),
grows back when a node is added, and ends SUCCEEDED on the loss curve of a fixed-size run.

About 3.5 minutes on two quiet cores (8 to 10 at a load average of 20 to 60, where the final waits below are long
enough; at a load average of 7 a lost node's recovery, new ranks started on the bundles left, took 62 s, so each resize
may take 300 s), so it is marked slow: `make test-slow` runs it (not `make test`, which must stay well under 15
minutes)."""

from __future__ import annotations

import os

import pytest
from helpers import slow, tiny_spec, wait_for, wait_terminal
from test_serve_process import start_serve

COMMON = {"steps": 300, "global_batch": 8, "resources": {"cpus_per_worker": 2}}
FIXED = tiny_spec(**COMMON, parallel={"dp": 2, "microbatches": 2}, name="fixed")
ELASTIC = tiny_spec(**COMMON, parallel={"dp": {"min": 1, "max": 4}, "microbatches": 4}, name="elastic",
                    checkpoint={"every": 5}, fault={"node_grace_s": 2, "grow_interval_s": 1})


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"  # tests only: the product keeps Ray's token auth on
    # Two nodes of 4 CPUs: dp=4 at 2 CPUs a rank fills both.
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 4, "include_dashboard": False, "object_store_memory": 100 * 2**20})
    cluster.add_node(num_cpus=4, object_store_memory=100 * 2**20)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def _resizes(client, job_id: str) -> list[tuple[int, int, str]]:
    return [(e["from"]["dp"], e["to"]["dp"], e["reason"]) for e in client.events(job_id) if e["kind"] == "resize"]


@slow
def test_an_elastic_job_follows_the_cluster_as_it_shrinks_and_grows(cluster, tmp_path):
    proc, client = start_serve(tmp_path / "state", tmp_path / "serve.log", ray_address=cluster.address)
    try:
        reference = wait_terminal(client, client.submit(FIXED), 900)
        assert reference["status"] == "SUCCEEDED", reference["error"]
        job_id = client.submit(ELASTIC)
        wait_for(lambda: _resizes(client, job_id) == [(1, 4, "resources appeared")], 300, "the job to grow to 4")
        wait_for(lambda: client.job(job_id)["status"] == "RUNNING", 60, "the job to run at dp=4")
        head = cluster.head_node.node_id
        worker_node = next(n for n in cluster.list_all_nodes() if n.node_id != head)
        assert worker_node.node_id in {r["node_id"] for r in client.job(job_id)["ranks"]}
        cluster.remove_node(worker_node)
        wait_for(lambda: (4, 2, "node lost") in _resizes(client, job_id), 300, "the job to shrink to 2")
        cluster.add_node(num_cpus=4, object_store_memory=100 * 2**20)
        wait_for(lambda: _resizes(client, job_id)[-1] == (2, 4, "resources appeared"), 300, "the job to grow back")
        job = wait_terminal(client, job_id, 900)
        assert job["status"] == "SUCCEEDED", job["error"]
        ours, theirs = client.metrics(job_id), client.metrics(reference["job_id"])
        assert [r["step"] for r in ours] == list(range(COMMON["steps"]))
        for row, ref in zip(ours, theirs, strict=True):
            assert row["loss"] == pytest.approx(ref["loss"], rel=1e-4), row["step"]
        lost = next(e for e in client.events(job_id) if e["kind"] == "resize" and e["reason"] == "node lost")
        assert lost["moved"] == "checkpoint" and lost["paused_s"] > 0
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=60)
