"""The Worker actor: one rank of a job, a thin Ray shell around `parallel.runtime.driver.RankDriver` (the process
groups, the trainer, the steps and the checkpoints; the gloo tests and the benches drive the same class).

The coordinator creates one per rank, pinned to the job's placement group, and calls it once to
rendezvous (`address`, then `setup` on all ranks at once) and once per step (`run_step`, which returns the previous
step's figures: `RankDriver.queue_step`, as `StepReport`s), then once for the last step's figures (`flush`). Exceptions
propagate to the coordinator with their traceback; the coordinator then kills every rank, so a peer
blocked in a collective never hangs the job. A failing `setup` or `run_step` also prints its traceback to
the rank's stderr (Ray returns an actor method's exception to the caller and logs it nowhere), so that
`GET /api/jobs/{id}/logs?rank=R` shows it in the rank's own log.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import ray
from trainyard.actors.calls import first_line
from trainyard.actors.worker_group.oom_killer import confine_memory, read_oom_counters
from trainyard.parallel.plan import Plan
from trainyard.parallel.runtime.host_memory import resident_bytes
from trainyard.parallel.runtime.step.step_stats import Save, StepReport

if TYPE_CHECKING:
    from trainyard.parallel.runtime.driver import RankDriver
    from trainyard.parallel.runtime.open_loop import OpenLoopRank


class Drill(Protocol):
    """A fault drill as the coordinator hands it over (`actors.actions.requests.Drill`; not imported: the actions
    import this room)."""

    kind: str
    factor: float


# torch and the trainer are imported in the rank's process when it is created, not where the class is defined:
# the coordinator creates workers from this class and must not pay seconds of torch import as each job starts.


@ray.remote
class Worker:
    def __init__(self, job_id: str, rank: int, threads: int):
        import torch

        self.job_id, self.rank = job_id, rank
        # Ray sets OMP_NUM_THREADS from the CPU request; a fractional request would give 0 or 1 anyway.
        torch.set_num_threads(max(1, threads))
        self.driver: RankDriver | None = None
        self._kept: dict | None = None
        self._open: OpenLoopRank | None = None
        """A Tinker training client's open loop on this rank (`open_loop`), once called."""
        self._step_failed = False
        self._slow_factor = 1.0
        """The slow_rank drill's factor on this rank's steps (1: none)."""
        """A step raised here: the steps queued after it are refused until the recovery sets this rank up again
        (one would block on the peers the failure left waiting, and hold up the recovery's call behind it)."""

    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process-group store."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, plan: Plan, master_addr: str, master_port: int, rank: int | None = None) -> dict:
        """Join the job's process groups as `rank` (its rank so far when None; a resize may renumber it) and
        build this rank's trainer."""
        self.rank = self.rank if rank is None else rank
        self._step_failed = False
        self._open = None  # a new driver: its open loop is built anew at the next call
        from trainyard.parallel.runtime.driver import RankDriver

        baseline = resident_bytes("VmRSS")  # the process before its trainer: Ray's worker, torch and their imports
        with self._traceback_to_stderr("setup"):
            self.driver = RankDriver(plan, self.rank, master_addr, master_port)
        context = ray.get_runtime_context()
        info = {"rank": self.rank, "device": str(self.driver.device), "node": ray.util.get_node_ip_address(),
                "node_id": context.get_node_id(), "pid": os.getpid(), "actor_id": context.get_actor_id(),
                "baseline_rss_bytes": baseline,
                "oom_counts": read_oom_counters()}  # what a later death by the kernel's OOM killer is told by
        print(f"job {self.job_id} rank {self.rank} ({plan.worker_name(self.rank)}) of {plan.world_size} ready on "
              f"{info['node']} (pid {info['pid']}, {info['device']})", file=sys.stderr, flush=True)
        return info

    def open_loop(self, method: str, kwargs: dict, host: str = "default") -> dict:
        """A Tinker training client's call on this rank (`actors.client_session`): `forward_backward` (its datums
        as dicts of `tokens`, `target_tokens` and the loss's inputs), `optim_step` (the Adam parameters),
        `save_for_sampler` or `sample` (a sampling client's: a snapshot of the weights, a generation), `save_state`
        or `load_state` (a checkpoint), on the open loop built on this rank's driver at its first call
        (`parallel.runtime.open_loop.OpenLoopRank`, whose first tenant is `host`); `add_tenant`, `drop_tenant`:
        another LoRA client on this rank's base (`parallel.runtime.tinker.tenants`)."""
        assert self.driver is not None, "setup() must run before open_loop()"
        from trainyard.parallel.runtime.open_loop import OpenLoopRank, datum_of

        with self._traceback_to_stderr(f"the training client's {method}"):
            if self._open is None:
                self._open = OpenLoopRank(self.driver, host)
            if method == "forward_backward":
                data = [datum_of(d) for d in kwargs.pop("data")]
                return self._open.forward_backward(data, **kwargs)
            if method in ("save_for_sampler", "sample", "save_state", "load_state", "add_tenant", "drop_tenant"):
                return getattr(self._open, method)(**kwargs)
            return self._open.optim_step(**kwargs)

    def param_buckets(self, owner: list[int]) -> tuple[list, ...] | list:
        """parameter_server: this rank's trainable parameters (on the host) in one bucket per shard, by `owner`
        (the shard of each, `assign_shards`); a shard's bucket alone when there is one (a call's single return)."""
        assert self.driver is not None, "setup() must run before param_buckets()"
        params = [p.detach().cpu() for p in self.driver.trainer.server_params()]
        buckets = tuple([p for p, o in zip(params, owner, strict=True) if o == s] for s in range(max(owner) + 1))
        return buckets[0] if len(buckets) == 1 else buckets

    def param_sizes(self) -> list[int]:
        assert self.driver is not None, "setup() must run before param_sizes()"
        return [p.numel() for p in self.driver.trainer.server_params()]

    def use_shards(self, shards: list, owner: list[int], step: int) -> None:
        """parameter_server: this rank's parameters are the `shards`' from now on, pulled for `step` (the next)."""
        from trainyard.actors.ps_shard import RayTransport

        assert self.driver is not None, "setup() must run before use_shards()"
        with self._traceback_to_stderr("joining the parameter server"):
            dp_rank = self.driver.plan.coords(self.rank).dp
            self.driver.trainer.serve(RayTransport(shards, owner, dp_rank), step)

    def load_checkpoint(self, directory: str, step: int) -> None:
        assert self.driver is not None, "setup() must run before load_checkpoint()"
        self._kept = None  # a recovery that kept this rank's state went through the checkpoint instead
        with self._traceback_to_stderr(f"loading the checkpoint of step {step}"):
            self.driver.load(Path(directory), step)

    def run_step(self, step: int, microbatch_ids: list[list[int]] | None, evaluate: bool = False,
                 save: Save | None = None, drill: Drill | None = None, round_: dict | None = None
                 ) -> list[StepReport]:
        """One training step queued; then, if asked, the validation loss and a checkpoint of the state after it
        (`save`). Returns the reports of the steps finished since the last call (`RankDriver.queue_step`: the
        previous step's, and this one's when it evaluates or saves); the report says how long the checkpoint
        blocked the step. `drill` is a fault drill (`kill_worker`: the process exits;
        `hang_worker`: the step never returns; `slow_rank`: this and every later step take `factor` times as long).
        `microbatch_ids` None: this rank's share of the step's global batch,
        drawn here from (seed, step). `round_`: who takes part while a replica is dropped."""
        assert self.driver is not None, "setup() must run before run_step()"
        if self._step_failed:
            raise RuntimeError(f"rank {self.rank} did not run step {step}: an earlier step failed here")
        if drill is not None and drill.kind == "slow_rank":
            print(f"rank {self.rank}: fault drill slow_rank x{drill.factor} from step {step}", file=sys.stderr,
                  flush=True)
            self._slow_factor = drill.factor
        elif drill is not None:
            _run_drill(drill.kind, self.rank, step)
        try:
            with self._traceback_to_stderr(f"step {step}"):
                start = time.perf_counter()
                finished = self.driver.queue_step(step, microbatch_ids, evaluate=evaluate, save=save, round_=round_)
                # slow_rank: a straggler, made by sleeping in proportion to the step's measured time (a drill)
                time.sleep((self._slow_factor - 1.0) * (time.perf_counter() - start))
                return [StepReport.of(stats, peak_rss_bytes()) for stats in finished]
        except Exception:
            self._step_failed = True
            raise

    def flush(self) -> list[StepReport]:
        """The figures of the last step queued ([] when they were returned already): at the job's end, a stop or
        a resize. A diverged step raises, naming it."""
        assert self.driver is not None, "setup() must run before flush()"
        if self._step_failed:
            raise RuntimeError(f"rank {self.rank} has no step to flush: a step failed here")
        try:
            with self._traceback_to_stderr("reading the last step's figures"):
                return [StepReport.of(stats, peak_rss_bytes()) for stats in self.driver.flush()]
        except Exception:
            self._step_failed = True
            raise

    def final_checkpoint(self, root: str, steps_done: int, info: dict, saved: bool,
                         live: tuple[int, ...] | None = None) -> float:
        """The state at the job's end as a checkpoint (unless the last step just saved it), every save
        finished and committed; returns the seconds it took. `live`: the replicas stepping while others sit
        out (local_sgd, diloco)."""
        assert self.driver is not None
        with self._traceback_to_stderr("the final checkpoint"):
            return self.driver.final_checkpoint(Path(root), steps_done, info, saved, live)

    def export_model(self, directory: str, steps_done: int, out: str) -> str:
        """The model of the checkpoint in `directory` as one safetensors file at `out` (`parallel.io.export`); its
        path. Rank 0 does it for the coordinator, which does not import torch."""
        from trainyard.parallel.io.export import export_model

        assert self.driver is not None
        with self._traceback_to_stderr("exporting the model"):
            return str(export_model(self.driver.plan.config, Path(directory), steps_done, Path(out)))

    @contextlib.contextmanager
    def _traceback_to_stderr(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            if peer_lost(e):  # a consequence: the rank that failed (or died) first has the cause in its log
                print(f"rank {self.rank} stopped in {what}: a peer's connection closed ({first_line(e)})",
                      file=sys.stderr, flush=True)
            else:
                print(f"rank {self.rank} failed in {what}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise

    def keep_state(self, after_failure: bool = False) -> tuple[int | None, list[StepReport]]:
        """Before an in-memory resize, or after a failure (a live replica's state may spare the job its
        checkpoint): hold this rank's parameters and optimizer state, then leave the process groups
        (`adopt_state` takes them into the trainer of the new layout). Returns the steps that state holds (None:
        unknown, e.g. the failure came while it was being replaced, or its last step diverged; it is then no
        source for anyone) and the figures of the last steps this rank read, the one queued last read first (the
        failed call's answer may have been lost with them)."""
        steps: int | None = None
        last: list[StepReport] = []
        if self.driver is not None:
            with contextlib.suppress(Exception):  # a diverged step: `steps_done` is None then
                self.driver.flush()  # the figures of the step queued last: a local read, no peer needed
            last = [StepReport.of(stats) for stats in self.driver.recent]
            with self._traceback_to_stderr("keeping the state"):
                self._kept = self.driver.trainer.local_state(finish_saves=not after_failure)
                steps = self.driver.trainer.steps_done
        self.reset()
        return steps, last

    def adopt_state(self, step: int, source: int | None) -> None:
        assert self.driver is not None
        with self._traceback_to_stderr("taking the state after a resize"):
            self.driver.trainer.adopt_state(self._kept, step, source)
        self._kept = None

    def reset(self) -> None:
        """Leave the job's process groups and drop the trainer, so that `setup` can bring this process into
        a new rendezvous (recovery reuses the ranks that are alive and answering)."""
        from trainyard.parallel.runtime.distributed import shutdown_distributed

        self.driver, self._step_failed = None, False
        shutdown_distributed()  # the driver's groups, also those of a setup that failed half-way

    def shutdown(self) -> None:
        self.reset()


def _run_drill(drill: str, rank: int, step: int) -> None:
    print(f"rank {rank}: fault drill {drill} at step {step}", file=sys.stderr, flush=True)
    if drill == "kill_worker":
        os._exit(17)
    if drill == "hang_worker":
        while True:  # a rank stuck forever: only the coordinator's hang detection ends it
            time.sleep(3600)
    if drill == "oom_worker":
        _cap_memory_and_overflow()
    if drill == "oom_kill_worker":
        _overflow_a_memory_cgroup()
    raise ValueError(f"unknown drill {drill}")


def _cap_memory_and_overflow() -> None:
    """The rank's address space capped 256 MiB above its size now, then a 4 GiB tensor asked for: the OS
    refuses it as it refuses a rank whose node is full (the allocator raises), and the cap stays on."""
    import resource

    import torch

    size = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
    torch.empty(1 << 30, dtype=torch.float32).fill_(1.0)


def _overflow_a_memory_cgroup() -> None:
    """The rank moved into a memory cgroup of its own limited to 64 MiB more, then 1 GiB touched: the kernel's
    OOM killer SIGKILLs it, as it would on a full node or in a container at its limit (no Python error)."""
    import torch

    confine_memory(64 << 20, f"trainyard-drill-{os.getpid()}")
    torch.ones(1 << 28, dtype=torch.float32)
    raise RuntimeError("the oom_kill_worker drill's rank was not killed: its memory cgroup did not limit it")


PEER_LOST_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                   "NCCL communicator was aborted", "remote process exited")
"""What gloo and NCCL say when a peer of a collective or a send/receive went away (it failed and was reset, or
its process was killed): this rank's error is then a consequence, not a cause."""


def peer_lost(error: BaseException) -> bool:
    """Whether `error` says only that a peer of this rank's communication went away."""
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in PEER_LOST_SIGNS)


def peak_rss_bytes() -> int:
    """This process's resident high-water mark, as the OS counts it: VmHWM, what a node's memory monitor sees at
    its worst. Not getrusage's ru_maxrss, which also keeps the high-water mark of the image the process replaced at
    exec (a Ray worker's launcher); that one only where /proc is not (Linux reports KiB)."""
    hwm = resident_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
