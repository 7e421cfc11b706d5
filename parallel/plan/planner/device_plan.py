"""Planning on a cluster that is not this machine: N nodes of G devices of a named profile, each rank on one device.

`device_cluster(nodes, gpus_per_node, profile)` is the cluster as admission sees it (each node's GPUs with the
profile's memory); `plan_on_devices(config, nodes=, gpus_per_node=, device=)` resolves `parallel: auto` there
with the profile's costs (`planner.choose`, its search bounds as `planner_search` says) or takes the config's own
layout, and predicts it (`device_prediction`). The CLI's `trainyard plan --device` and bench section
`predictions` both come here. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from trainyard.parallel.config import JobConfig
from trainyard.parallel.plan.admission import ClusterResources, NodeResources
from trainyard.parallel.plan.planner.device_prediction import describe, predict_on_devices
from trainyard.parallel.plan.planner.device_profile import DeviceProfile, load_profile
from trainyard.parallel.plan.planner.planner import choose
from trainyard.parallel.plan.planner.planner_search import Search

HOST_MEMORY_PER_GPU = 256 * 2**30
"""A node's host memory per GPU (DGX A100/H100: 2 TiB for 8): what CPU offload may use."""
CPUS_PER_GPU = 8.0


def device_cluster(nodes: int, gpus_per_node: int, profile: DeviceProfile) -> ClusterResources:
    node = NodeResources(cpus=CPUS_PER_GPU * gpus_per_node, gpus=float(gpus_per_node),
                         memory=float(HOST_MEMORY_PER_GPU * gpus_per_node), gpu_memory=profile.hbm_bytes)
    return ClusterResources(nodes=(node,) * max(nodes, 1))


def plan_on_devices(config: JobConfig, *, nodes: int, gpus_per_node: int, device: str, auto: bool = False,
                    top: int = 5, gpu_memory: float = 0.0) -> tuple[JobConfig, dict]:
    """(the config to run, {"device", "nodes", "gpus_per_node", "prediction", "planner" (when planned)}): with
    `parallel: auto` or `auto` the planner's layout (a mapping's other options kept), else the config's own, each
    rank on one GPU (`resources.gpus_per_worker` 1 where it was auto), predicted with the profile's costs (0
    `gpus_per_node`: the profile's; a `gpu_memory` in bytes replaces the profile's HBM)."""
    if config.resources.gpus_per_worker == "auto":
        config = replace(config, resources=replace(config.resources, gpus_per_worker=1))
    profile = load_profile(device)
    if gpus_per_node and gpus_per_node != profile.gpus_per_node:
        profile = replace(profile, gpus_per_node=gpus_per_node)
    if gpu_memory:
        profile = replace(profile, hbm_bytes=gpu_memory)
    machine = profile.machine_costs()
    cluster = device_cluster(nodes, gpus_per_node or profile.gpus_per_node, profile)
    out: dict = {"device": profile.name, "nodes": max(nodes, 1), "gpus_per_node": profile.gpus_per_node}
    if config.parallel == "auto" or auto:
        chosen, result = choose(config, cluster, machine, top=top)
        best = next(c for c in result.candidates if c.config == replace(chosen, planned=c.config.planned))
        out["prediction"] = describe(best, Search(chosen, cluster, machine, 0.0)).to_dict()
        out["planner"] = result.to_dict()
        return chosen, out
    out["prediction"] = predict_on_devices(config, cluster, machine).to_dict()
    return config, out
