"""Placement on a two-node Ray cluster (`ray.cluster_utils.Cluster`, fake GPUs) that `trainyard serve
--ray-address` joins: each tensor-parallel group lands on one node, and a 3D job spans both nodes."""

from __future__ import annotations

import os

import pytest
from helpers import tiny_spec, wait_terminal
from test_serve_process import start_serve


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"  # tests only: the product keeps Ray's token auth on
    # 4 CPUs and 4 (fake) GPUs per node: a dp=2 x pp=2 x tp=2 job needs 4 bundles of 2 CPU + 2 GPU, so at
    # most 2 fit on a node and the job must use both.
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 4, "num_gpus": 4, "include_dashboard": False,
                                      "object_store_memory": 100 * 2**20})
    cluster.add_node(num_cpus=4, num_gpus=4, object_store_memory=100 * 2**20)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_a_job_is_placed_across_two_nodes_with_each_tp_group_on_one(two_node_cluster, tmp_path):
    proc, client = start_serve(tmp_path / "state", tmp_path / "serve.log", ray_address=two_node_cluster.address)
    try:
        cluster = client.cluster()
        assert cluster["nodes"] == 2 and cluster["gpus"] == 8
        spec = tiny_spec(steps=2, model={"n_layer": 4}, parallel={"dp": 2, "pp": 2, "tp": 2, "microbatches": 2})
        plan = client.plan(spec)
        assert plan["resources"]["bundles"] == [{"CPU": 2.0, "GPU": 2.0}] * 4
        job = wait_terminal(client, client.submit(spec), timeout_s=300)
        assert job["status"] == "SUCCEEDED", job["error"]
        node_of = {r["rank"]: r["node_id"] for r in job["ranks"]}
        assert len(node_of) == 8 and len(set(node_of.values())) == 2
        for group in plan["groups"]["tp"]:
            assert len({node_of[r] for r in group}) == 1, f"tp group {group} spans nodes"
        assert all(r["device"] == "cpu" for r in job["ranks"])  # fake GPUs: gloo on CPU, the GPU code path
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
