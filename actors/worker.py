"""The Worker actor: one rank of a job, a thin Ray shell around `parallel.trainer.RankTrainer`.

The coordinator creates one per rank, pinned to the job's placement group, and calls it once to
rendezvous (`address`, then `setup` on all ranks at once) and once per step (`run_step`). Exceptions
propagate to the coordinator with their traceback; the coordinator then kills every rank, so a peer
blocked in a collective never hangs the job.
"""

from __future__ import annotations

import os
import socket

import ray
import torch

from parallel.distributed import init_distributed, pick_device, shutdown_distributed
from parallel.plan import Plan
from parallel.trainer import RankTrainer


@ray.remote
class Worker:
    def __init__(self, job_id: str, rank: int, threads: int):
        self.job_id, self.rank = job_id, rank
        # Ray sets OMP_NUM_THREADS from the CPU request; a fractional request would give 0 or 1 anyway.
        torch.set_num_threads(max(1, threads))
        self.trainer: RankTrainer | None = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process-group store."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, plan: Plan, master_addr: str, master_port: int) -> dict:
        device = pick_device(plan.gpus_per_worker)
        groups = init_distributed(plan, self.rank, master_addr, master_port, device,
                                  timeout_s=plan.config.fault.step_timeout_s)
        self.trainer = RankTrainer(plan, self.rank, groups, device)
        return {"rank": self.rank, "device": str(device), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def run_step(self, step: int, microbatch_ids: list[list[int]]) -> dict:
        assert self.trainer is not None, "setup() must run before run_step()"
        return self.trainer.train_step(step, microbatch_ids).to_dict()

    def shutdown(self) -> None:
        self.trainer = None
        shutdown_distributed()
