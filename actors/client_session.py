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
raises `OpenLoopError` before any rank runs (its message names the field). A rank that raises or does not answer
within the job's `fault.step_timeout_s` fails the call (`call_all`: a deadline, never a hang), and leaves the client
unusable: every later call says so.

A rank that dies (its process gone: `StepFailed.dead`) is recovered instead: every rank of the client is replaced in
its reserved bundles, the new ranks load the state the client last saved or loaded (`restore_point`; none: the base
model with fresh adapters, as the client began), and the call that met the death fails with `ClientRecovered`,
saying what the client went back to; the next call runs on the rebuilt ranks. What was done since that state
(steps, accumulated gradients, in-memory sampler weights) is lost, and the error says so. A client whose rebuild
fails is unusable, as above.

Tenants (`parallel.runtime.tinker.tenants`): another LoRA client of the same base model at the same layout may attach to
these ranks instead of having its own (`attach`; the service decides, `service.tinker.clients`), a tenant named by
its model id: the ranks hold the base once, each tenant its adapters, optimizer state, step count and sampler
weights, and every call names its tenant. The calls of different tenants take turns fairly by user
(`actors.client_turns`), each tenant's in its own order. `detach` forgets a tenant's state; the service releases
the actor with its last tenant. A recovery rebuilds every tenant, each from the state it last saved or loaded. The
client that built the ranks (`host`) is a tenant as the others are: it may go first.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from trainyard.actors.calls import StepFailed
from trainyard.actors.client_turns import Turns
from trainyard.actors.worker_group.worker_group import WorkerGroup
from trainyard.parallel.io import checkpoint
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
        self.turns = Turns()
        """Whose call runs next (`run`)."""
        self.seeds: dict[str, int | None] = {model_id: None}
        """The tenants on the ranks, each with the seed of its adapters (None: the host's, the plan's own)."""
        self.restore_points: dict[str, tuple[str, int, bool]] = {}
        """Each tenant's (checkpoint step directory, step, with its optimizer) of the state it last saved or loaded,
        as `load_state` takes them: what a recovery loads (none: fresh adapters, as it began)."""

    async def run(self, tenant: str, user: str, seq: int, method: str, *args: Any) -> Any:
        """Call `method` for `tenant` (a model id; `user`'s) in its turn: one call at a time, each tenant's in the
        order the service numbered them (from 0: `setup` or `attach`), whatever order Ray delivers them in (it
        keeps no order for an async actor's calls: a large argument was seen to arrive after the next call's), the
        tenants taking turns by user (`actors.client_turns`). A call that fails passes the turn on all the same."""
        async with self._turns:
            self.turns.arrive(tenant, seq, user)
            await self._turns.wait_for(lambda: self.turns.pick() == (tenant, seq))
            self.turns.start(tenant, seq)
        try:
            return await getattr(self, method)(tenant, *args)
        finally:
            async with self._turns:
                self.turns.done(tenant)
                self._turns.notify_all()

    def admit(self, pg: PlacementGroup) -> None:
        """The client's turn in the service's queue came: its ranks go into `pg`, reserved for them (`setup`,
        waiting until now, builds them). Runs out of turn."""
        self.group = WorkerGroup(f"tinker-{self.model_id}", self.plan, pg)
        self._admitted.set()

    async def setup(self, tenant: str) -> dict[str, Any]:
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

    async def attach(self, tenant: str, seed: int) -> dict[str, Any]:
        """A new tenant on the built ranks: fresh adapters from `seed`, as a client of its own starts."""
        await self._on_every_rank("add_tenant", tenant, [{"name": tenant, "seed": seed}] * self.plan.world_size)
        self.seeds[tenant] = seed
        return {"model_id": tenant, "device": self.group.ranks[0].get("device") if self.group else None,
                "world_size": self.plan.world_size, "tenants": len(self.seeds)}

    async def detach(self, tenant: str) -> dict[str, Any]:
        """Tenant `tenant`'s state forgotten on every rank; the tenants left."""
        self.seeds.pop(tenant, None)
        self.restore_points.pop(tenant, None)
        if self.broken is None and self.group is not None:
            await self._on_every_rank("drop_tenant", tenant, [{"name": tenant}] * self.plan.world_size)
        return {"tenants": len(self.seeds)}

    async def forward_backward(self, tenant: str, data: list[dict[str, list]], loss_fn: str, forward_only: bool,
                               config: dict[str, float] | None = None) -> dict[str, Any]:
        """`data`: each datum's `tokens`, `target_tokens` and the loss's inputs by name; `config`: the loss's.
        Returns every datum's `logprobs`, in order, and `metrics` (`loss:sum` over every datum)."""
        from trainyard.parallel.runtime.open_loop import check_call, datum_of, shares

        check_call([datum_of(d) for d in data], loss_fn, self.plan.config.model.seq_len, config)
        split = shares(len(data), self.plan.dp)
        calls = [{"data": [data[i] for i in split[self.plan.coords(r).dp]], "loss_fn": loss_fn,
                  "forward_only": forward_only, "config": config} for r in range(self.plan.world_size)]
        outs = await self._on_every_rank("forward_backward", tenant, calls)
        firsts = [next(r for r in range(self.plan.world_size) if self.plan.coords(r).dp == dp)
                  for dp in range(self.plan.dp)]  # one rank of each replica answers for it
        return {"logprobs": [row for r in firsts for row in outs[r]["logprobs"]],
                "metrics": {"loss:sum": sum(outs[r]["metrics"]["loss:sum"] for r in firsts)}}

    async def optim_step(self, tenant: str, adam: dict[str, float]) -> dict[str, Any]:
        outs = await self._on_every_rank("optim_step", tenant, [dict(adam) for _ in range(self.plan.world_size)])
        return outs[0]

    async def save_state(self, tenant: str, root: str, info: dict, answer: dict[str, Any]) -> dict[str, Any]:
        """A DCP checkpoint of the client's state under `root` (every rank its part, rank 0 commits it:
        `OpenLoopRank.save_state`); `answer` once it is committed."""
        outs = await self._on_every_rank("save_state", tenant, [{"root": root, "info": info}
                                                                for _ in range(self.plan.world_size)])
        steps = int(outs[0]["steps"])
        self.restore_points[tenant] = (str(checkpoint.step_dir(Path(root), steps)), steps, True)
        return answer

    async def load_state(self, tenant: str, directory: str, step: int, optimizer: bool, answer: dict[str, Any]
                         ) -> dict[str, Any]:
        """The checkpoint of `step` in `directory` loaded on every rank (with its optimizer state when
        `optimizer`), whatever layout wrote it; `answer` once every rank holds it."""
        await self._on_every_rank("load_state", tenant, [{"directory": directory, "step": step,
                                                          "optimizer": optimizer}
                                                         for _ in range(self.plan.world_size)])
        self.restore_points[tenant] = (directory, step, optimizer)
        return answer

    async def save_for_sampler(self, tenant: str, name: str, drop: list[str], answer: dict[str, Any]
                               ) -> dict[str, Any]:
        """The weights now as sampler weights `name`, in the memory of the rank that samples (the first: every
        replica holds the same weights), those named in `drop` forgotten; then `answer` (the SDK's)."""
        await self._on_every_rank("save_for_sampler", tenant,
                                  [{"name": name, "drop": drop}] * len(self._first_replica), first_only=True)
        return answer

    async def sample(self, tenant: str, request: dict[str, Any], name: str | None) -> dict[str, Any]:
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
        outs = await self._on_every_rank("sample", tenant,
                                         [{"request": request, "name": name}] * len(self._first_replica),
                                         first_only=True)
        return outs[0]

    @property
    def _first_replica(self) -> list[int]:
        """The ranks of data-parallel replica 0 (one rank, or its tensor-parallel group)."""
        return [r for r in range(self.plan.world_size) if self.plan.coords(r).dp == 0]

    async def _on_every_rank(self, method: str, tenant: str, calls: list[dict], first_only: bool = False
                             ) -> list[dict]:
        """`method` for `tenant` on the ranks (`first_only`: the first replica's alone; `calls` holds one for
        each); the tenant management calls (`add_tenant`, `drop_tenant`) name it themselves."""
        if self.broken is not None:
            raise RuntimeError(f"training client {self.model_id} is unusable: {self.broken}")
        assert self.group is not None  # `setup`, the first call, waited for it
        try:
            workers = [self.group.workers[r] for r in self._first_replica] if first_only else self.group.workers
            named = calls if method in ("add_tenant", "drop_tenant") else [{**c, "tenant": tenant} for c in calls]
            return await self.group.call([w.open_loop.remote(method, kwargs, self.model_id)
                                          for w, kwargs in zip(workers, named, strict=True)], method)
        except StepFailed as e:
            if not e.dead:  # raised or hung: nothing to recover from here
                self.broken = f"an earlier call failed ({_line(e)})"
                raise RuntimeError(f"training client {self.model_id}: {_line(e)}") from None
            went_back = await self._recover(e, tenant)
            raise ClientRecovered(f"training client {self.model_id}: a rank died during {method} ({_line(e)}); its "
                                  f"ranks were rebuilt from {went_back}, and what was done since is lost (steps, "
                                  "accumulated gradients, sampler weights in memory): this call did not run, the "
                                  "next ones do") from None
        except Exception as e:
            self.broken = f"an earlier call failed ({_line(e)})"
            raise RuntimeError(f"training client {self.model_id}: {_line(e)}") from None

    async def _recover(self, death: BaseException, tenant: str) -> str:
        """Every rank replaced in the client's bundles, every tenant on them again, each given its `restore_points`
        state; what `tenant` went back to (for the error). Unusable (`broken`) if that fails."""
        assert self.group is not None
        try:
            for rank in range(len(self.group.workers)):
                self.group.kill(rank)
            group = self.group
            await group.start()

            async def on_ranks(method: str, kwargs: dict) -> None:
                await group.call([w.open_loop.remote(method, kwargs, self.model_id) for w in group.workers],
                                 f"rebuilding the client's tenants ({method})")
            for name, seed in self.seeds.items():  # the host is the rebuilt ranks' first tenant
                if name != self.model_id:
                    await on_ranks("add_tenant", {"name": name, "seed": seed})
            if self.model_id not in self.seeds:  # the host left already: its fresh state goes too
                await on_ranks("drop_tenant", {"name": self.model_id})
            for name, (directory, step, optimizer) in self.restore_points.items():
                await on_ranks("load_state", {"directory": directory, "step": step, "optimizer": optimizer,
                                              "tenant": name})
            point = self.restore_points.get(tenant)
            went_back = ("the base model with fresh adapters (it saved no state)" if point is None else
                         f"the state it last saved or loaded (at its step {point[1]})")
        except Exception as e:
            self.broken = f"a rank died ({_line(death)}) and its ranks could not be rebuilt ({_line(e)})"
            raise RuntimeError(f"training client {self.model_id}: {self.broken}") from None
        return went_back


class ClientRecovered(RuntimeError):
    """A rank died during the call, which did not run; the client's ranks were rebuilt (the message says from what)
    and its next calls run."""


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
