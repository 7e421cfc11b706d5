"""The ClientSession actor: one training client of the Tinker-compatible API (`service.tinker`), a live job of its
own kind. Instead of the coordinator's fixed loop, it holds the client's ranks (a `WorkerGroup` on the placement
group the service reserved, built as a job's ranks are) between calls, and runs each call the user's program makes
on them: every rank runs `Worker.open_loop` (`parallel.runtime.open_loop.OpenLoopRank`), each data-parallel replica
on its share of the datums, and the gradient reducers sum the replicas' gradients at `optim_step`. A sampling
client's calls (`save_for_sampler`, `sample`) run on the first replica's ranks alone (one rank, or its tensor-parallel
group in lockstep), which hold every replica's weights.

The actor is made when the client is created and waits, holding nothing, while the client waits in the service's
queue (a job of kind `tinker`); admission reserves its placement group and hands it over (`admit`), and `setup`
builds the ranks in it. One call at a time, in the order the service numbered them (`run`), which is the order the
SDK's requests arrived in; calls made while the client waits run once it is built. A call the caller got wrong
raises `OpenLoopError` before any rank runs (its message names the field). A rank that raises, dies or does not
answer within the job's `fault.step_timeout_s` fails the call (`call_all`: a deadline, never a hang), and leaves the
client unusable: every later call says so.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from trainyard.actors.worker_group.worker_group import WorkerGroup
from trainyard.parallel.plan import Plan


@ray.remote
class ClientSession:
    def __init__(self, model_id: str, plan: Plan):
        self.model_id, self.plan = model_id, plan
        self.group: WorkerGroup | None = None
        """The client's ranks, once admission reserved their placement group (`admit`)."""
        self.broken: str | None = None
        """Why the client is unusable (a call failed on a rank), or None."""
        self._admitted = asyncio.Event()
        self._turns = asyncio.Condition()
        self._next = 0
        """The number of the call whose turn it is (`run`)."""

    async def run(self, seq: int, method: str, *args: Any) -> Any:
        """Call `method` in its turn: the calls run one at a time, in the order the service numbered them (from 0,
        `setup`), whatever order Ray delivers them in (it keeps no order for an async actor's calls: a large
        argument was seen to arrive after the next call's). A call that fails passes the turn on all the same."""
        async with self._turns:
            await self._turns.wait_for(lambda: self._next == seq)
        try:
            return await getattr(self, method)(*args)
        finally:
            async with self._turns:
                self._next += 1
                self._turns.notify_all()

    def admit(self, pg: PlacementGroup) -> None:
        """The client's turn in the service's queue came: its ranks go into `pg`, reserved for them (`setup`,
        waiting until now, builds them). Runs out of turn."""
        self.group = WorkerGroup(f"tinker-{self.model_id}", self.plan, pg)
        self._admitted.set()

    async def setup(self) -> dict[str, Any]:
        """Once admitted: create the ranks, rendezvous, build each (its process groups, the model from
        `init_from`, LoRA, the reducers, the optimizer)."""
        await self._admitted.wait()
        assert self.group is not None
        try:
            await self.group.start()
        except Exception as e:
            self.broken = f"its ranks could not be built ({_line(e)})"
            raise
        return {"model_id": self.model_id, "device": self.group.ranks[0].get("device"),
                "world_size": self.plan.world_size}

    async def forward_backward(self, data: list[dict[str, list]], loss_fn: str, forward_only: bool,
                               config: dict[str, float] | None = None) -> dict[str, Any]:
        """`data`: each datum's `tokens`, `target_tokens` and the loss's inputs by name; `config`: the loss's.
        Returns every datum's `logprobs`, in order, and `metrics` (`loss:sum` over every datum)."""
        from trainyard.parallel.runtime.open_loop import check_call, datum_of, shares

        check_call([datum_of(d) for d in data], loss_fn, self.plan.config.model.seq_len, config)
        split = shares(len(data), self.plan.dp)
        calls = [{"data": [data[i] for i in split[self.plan.coords(r).dp]], "loss_fn": loss_fn,
                  "forward_only": forward_only, "config": config} for r in range(self.plan.world_size)]
        outs = await self._on_every_rank("forward_backward", calls)
        firsts = [next(r for r in range(self.plan.world_size) if self.plan.coords(r).dp == dp)
                  for dp in range(self.plan.dp)]  # one rank of each replica answers for it
        return {"logprobs": [row for r in firsts for row in outs[r]["logprobs"]],
                "metrics": {"loss:sum": sum(outs[r]["metrics"]["loss:sum"] for r in firsts)}}

    async def optim_step(self, adam: dict[str, float]) -> dict[str, Any]:
        outs = await self._on_every_rank("optim_step", [dict(adam) for _ in range(self.plan.world_size)])
        return outs[0]

    async def save_state(self, root: str, info: dict, answer: dict[str, Any]) -> dict[str, Any]:
        """A DCP checkpoint of the client's state under `root` (every rank its part, rank 0 commits it:
        `OpenLoopRank.save_state`); `answer` once it is committed."""
        await self._on_every_rank("save_state", [{"root": root, "info": info} for _ in range(self.plan.world_size)])
        return answer

    async def load_state(self, directory: str, step: int, optimizer: bool, answer: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint of `step` in `directory` loaded on every rank (with its optimizer state when
        `optimizer`), whatever layout wrote it; `answer` once every rank holds it."""
        await self._on_every_rank("load_state", [{"directory": directory, "step": step, "optimizer": optimizer}
                                                 for _ in range(self.plan.world_size)])
        return answer

    async def save_for_sampler(self, name: str, drop: list[str], answer: dict[str, Any]) -> dict[str, Any]:
        """The weights now as sampler weights `name`, in the memory of the rank that samples (the first: every
        replica holds the same weights), those named in `drop` forgotten; then `answer` (the SDK's)."""
        await self._on_every_rank("save_for_sampler", [{"name": name, "drop": drop}] * len(self._first_replica),
                                  first_only=True)
        return answer

    async def sample(self, request: dict[str, Any], name: str | None) -> dict[str, Any]:
        """A Tinker sample on the first rank, at sampler weights `name` (None: the live weights); a request the
        rank cannot serve raises `OpenLoopError` (checked here first: the client stays usable)."""
        from trainyard.parallel.runtime.open_loop import OpenLoopError
        from trainyard.parallel.runtime.sampling.params import SampleError, has_tokenizer, sample_call

        cfg = self.plan.config
        try:
            sample_call(request, cfg.model.seq_len, cfg.model.vocab_size,
                        has_tokenizer(cfg.init_from.hf if cfg.init_from is not None else None))
        except SampleError as e:
            raise OpenLoopError(str(e)) from None
        params = dict(request.get("sampling_params") or {})
        if len(self._first_replica) > 1 and params.get("seed") is None:  # its ranks draw each token alike
            params["seed"] = random.randrange(2**63)
            request = {**request, "sampling_params": params}
        outs = await self._on_every_rank("sample", [{"request": request, "name": name}] * len(self._first_replica),
                                         first_only=True)
        return outs[0]

    @property
    def _first_replica(self) -> list[int]:
        """The ranks of data-parallel replica 0 (one rank, or its tensor-parallel group)."""
        return [r for r in range(self.plan.world_size) if self.plan.coords(r).dp == 0]

    async def _on_every_rank(self, method: str, calls: list[dict], first_only: bool = False) -> list[dict]:
        """`first_only`: the first replica's ranks alone (`calls` holds one for each)."""
        if self.broken is not None:
            raise RuntimeError(f"training client {self.model_id} is unusable: {self.broken}")
        assert self.group is not None  # `setup`, the first call, waited for it
        try:
            workers = [self.group.workers[r] for r in self._first_replica] if first_only else self.group.workers
            return await self.group.call([w.open_loop.remote(method, kwargs)
                                          for w, kwargs in zip(workers, calls, strict=True)], method)
        except Exception as e:
            self.broken = f"an earlier call failed ({_line(e)})"
            raise RuntimeError(f"training client {self.model_id}: {_line(e)}") from None


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
