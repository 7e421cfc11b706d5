"""The job's ranks: one Worker actor per rank, each on its slot (a placement group and a bundle index, one
per tensor-parallel group (pp, dp)), and the spare and grown slots an elastic job moves between; a parameter
server's shard actors (`actors.ps_shard`), outside the slots.

The admitted placement group is the service's (it reserved it and removes it). Groups reserved here to grow
(`<name>-growN`) are this group's to give back. Nothing here decides anything: the controller and its
policies (`actors.failure_handling`, `actors.scaling_policy`) say what to create, reuse, kill or move.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from trainyard.actors.calls import Failure, call_all
from trainyard.actors.naming import NAMESPACE, coordinator_name, placement_group_name, ps_shard_name, worker_name
from trainyard.actors.ps_shard import shards_of
from trainyard.actors.worker_group.worker import Worker
from trainyard.parallel.plan import Plan
from trainyard.parallel.plan.sync.parameter_server import assign_shards
from trainyard.parallel.runtime.step.step_stats import StepReport

Slot = tuple[PlacementGroup, int]
log = logging.getLogger("trainyard.coordinator")

RESET_TIMEOUT_S = 10.0
"""How long a rank that raised may take to leave its process groups before it is replaced instead."""
GROW_RESERVE_S = 10.0
"""How long a resize that adds ranks waits for their resources before it is refused."""


def slot_keys(plan: Plan) -> set[tuple[int, int]]:
    return {(plan.coords(r).pp, plan.coords(r).dp) for r in range(plan.world_size)}


def placed(slot: Slot, alive: set[str] | None = None) -> bool:
    """Whether Ray has the bundle on a live node now (not while it re-places the bundles of a lost node).
    `alive`: the live nodes' ids; the table may still name a node Ray has just declared dead."""
    try:
        node = ray.util.placement_group_table(slot[0])["bundles_to_node_id"].get(slot[1])
    except Exception:  # noqa: BLE001 - a group removed meanwhile
        return False
    return bool(node) and (alive is None or node in alive)


def remove_grown_placement_groups(job_id: str) -> list[str]:
    """Remove the placement groups a coordinator of the job reserved to grow (`<name>-growN`, detached) and did
    not give back: it died (the service, once the job ended; a restarted coordinator, whose predecessor's ranks
    died with it and whose grown bundles would otherwise stay reserved, and their names taken, until the job
    ends). By id, not name: a removed group keeps its name in the table. Returns the names removed."""
    prefix, removed = f"{placement_group_name(job_id)}-grow", []
    for pg_id, entry in ray.util.placement_group_table().items():
        if entry.get("name", "").startswith(prefix) and entry.get("state") != "REMOVED":
            with contextlib.suppress(Exception):  # removed meanwhile
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
                removed.append(entry["name"])
    return removed


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def dead_nodes() -> list[str]:
    """The nodes Ray lists as dead, as "id (address)"."""
    return [f"{n['NodeID']} ({n.get('NodeManagerAddress', '?')})" for n in ray.nodes() if not n.get("Alive")]


class WorkerGroup:
    def __init__(self, job_id: str, plan: Plan, pg: PlacementGroup):
        self.job_id, self.plan = job_id, plan
        self.workers: list = []
        self.ranks: list[dict] = []
        """Where each rank runs (rank, name, node, node_id, pid, device), once the workers are set up."""
        self.oom_counts: list[dict | None] = []
        """The OOM-kill counts on each rank's node at its setup (`oom_killer.read_oom_counters`)."""
        self.slots: dict[tuple[int, int], Slot] = {
            (plan.coords(r).pp, plan.coords(r).dp): (pg, plan.bundle_of(r)) for r in range(plan.world_size)}
        self.spare: list[Slot] = []
        """Reserved bundles no rank uses (after a shrink, or reserved for a growth under way)."""
        self.grown: list[PlacementGroup] = []
        """Placement groups reserved to grow (the admitted one is the service's)."""
        self.shards: list = []
        """parameter_server: the job's shard actors (`actors.ps_shard`), once the ranks took their state."""

    def actor_names(self) -> list[str]:
        return [coordinator_name(self.job_id)] + [
            worker_name(self.job_id, self.plan.worker_name(r)) for r in range(self.plan.world_size)]

    def rank_info(self, rank: int) -> dict:
        return self.ranks[rank] if rank < len(self.ranks) else {}

    async def call(self, refs: list, what: str, timeout: float | None = None, hang: bool = False,
                   next_calls: list | None = None) -> list:
        timeout = self.plan.config.fault.step_timeout_s if timeout is None else timeout
        return await call_all(refs, what, timeout, self.plan, self.ranks, hang, next_calls)

    async def _new_worker(self, rank: int):
        plan, c = self.plan, self.plan.coords(rank)
        pg, bundle = self.slots[(c.pp, c.dp)]
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
        options = {"name": worker_name(self.job_id, plan.worker_name(rank)), "num_cpus": plan.cpus_per_worker,
                   "num_gpus": plan.gpus_per_worker, "scheduling_strategy": strategy}
        for _ in range(50):  # the name of a rank just killed (a shrink, a recovery) is free a moment later
            try:
                return Worker.options(**options).remote(self.job_id, rank, int(plan.cpus_per_worker))  # type: ignore[attr-defined]  # an ActorClass (@ray.remote)
            except ValueError:
                await asyncio.sleep(0.1)
        return Worker.options(**options).remote(self.job_id, rank, int(plan.cpus_per_worker))  # type: ignore[attr-defined]  # an ActorClass (@ray.remote)

    async def start(self) -> None:
        """Create a worker for every rank that has none, then rendezvous and set every rank up."""
        plan = self.plan
        self.workers = [self.workers[r] if r < len(self.workers) and self.workers[r] is not None
                        else await self._new_worker(r) for r in range(plan.world_size)]
        addr, port = (await self.call([self.workers[0].address.remote()], "rendezvous"))[0]
        setups = await self.call([w.setup.remote(plan, addr, port, r) for r, w in enumerate(self.workers)], "setup")
        # The OOM-kill counts each rank's node had at its setup: the controller's, not shown in the job's `ranks`
        self.oom_counts = [info.pop("oom_counts", None) for info in setups]
        self.ranks = [{**info, "name": plan.worker_name(info["rank"])} for info in setups]

    async def load(self, point: tuple[str, int] | None) -> None:
        """Every rank takes the state of `point` (None: the start); a parameter server's shards are made anew from
        rank 0's (`start_shards`)."""
        if point is not None:
            directory, step = point
            await self.call([w.load_checkpoint.remote(directory, step) for w in self.workers],
                            f"loading the checkpoint of step {step}")
        if self.plan.sync.server:
            await self.start_shards(0 if point is None else point[1])

    async def start_shards(self, step: int) -> None:
        """parameter_server: the job's shards (those of a start before this one killed), each made from its bucket
        of rank 0's parameters (straight from rank 0: an object ref each), the job going on at `step`; then every
        rank pulls its parameters from them."""
        self.kill_shards()
        plan, sync = self.plan, self.plan.parallel.sync
        [sizes] = await self.call([self.workers[0].param_sizes.remote()], "the parameter server's sizes")
        owner = assign_shards(sizes, sync.shards)
        buckets = self.workers[0].param_buckets.options(num_returns=sync.shards).remote(owner)
        for s in range(sync.shards):  # the names of the shards just killed are free a moment later
            for _ in range(50):
                try:
                    ray.get_actor(ps_shard_name(self.job_id, s), namespace=NAMESPACE)
                except ValueError:
                    break
                await asyncio.sleep(0.1)
        self.shards = shards_of(self.job_id, [buckets] if sync.shards == 1 else list(buckets), plan.config.optimizer,
                                sync, plan.dp, plan.config.steps, step)
        await self.call([w.use_shards.remote(self.shards, owner, step) for w in self.workers],
                        "joining the parameter server")

    async def shard_updates(self) -> list[dict]:
        """parameter_server: every update the first shard applied (each shard applies every push: one is all of
        them), `ParameterShard.metrics`."""
        return await self.shards[0].metrics.remote() if self.shards else []

    def kill_shards(self) -> None:
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        self.shards = []

    def kill(self, rank: int) -> None:
        if rank < len(self.workers) and self.workers[rank] is not None:
            ray.kill(self.workers[rank], no_restart=True)
            self.workers[rank] = None

    async def tear_down(self, failure: Failure, upcoming: list, keep_state: bool = False
                        ) -> dict[int, tuple[int | None, list[StepReport]]]:
        """After a failure: ranks that raised are reset (and kept), every other rank is killed. `keep_state`: the
        kept ranks hold their state (`Worker.keep_state`), and when a rank died, every rank alive is given the same
        chance, except those of a replica holding a dead rank, which are replaced (their exit frees the ranks
        blocked on them; one that stays blocked is killed after RESET_TIMEOUT_S). Returns the kept ranks,
        the steps their state holds (None: unknown, or not kept) and the figures of the last steps they read
        (`Worker.keep_state`)."""
        for ref in upcoming:  # the step queued ahead: not to run on the ranks kept
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - already run or gone
                pass
        from trainyard.actors.failure_handling.replicas import replicas_to_replace

        reusable = failure.reusable
        if keep_state and failure.dead:
            # Every rank alive may hold the state, those that answered the failed step too (they are in the next
            # one). The replicas of the dead ranks are replaced whole: their ranks may be blocked on the dead
            # ones, and the other replicas' on them, which only their exit frees (`replicas.replicas_to_replace`).
            reusable = set(range(len(self.workers))) - set(failure.dead)
            reusable -= replicas_to_replace(self.plan, set(failure.dead))
        for rank in range(len(self.workers)):  # first, so that no kept rank waits on them
            if rank not in reusable:
                self.kill(rank)
        resets = {asyncio.ensure_future(self.workers[r].keep_state.remote(after_failure=True) if keep_state
                                        else self.workers[r].reset.remote()): r
                  for r in reusable if self.workers[r] is not None}
        done, late = await asyncio.wait(resets, timeout=RESET_TIMEOUT_S) if resets else (set(), set())
        kept: dict[int, tuple[int | None, list[StepReport]]] = {}
        for task in done | late:
            if task in done and task.exception() is None:
                kept[resets[task]] = task.result() if keep_state else (None, [])
            else:  # a rank that cannot even reset is replaced
                task.cancel()
                self.kill(resets[task])
        return kept

    def take(self, new: Plan, kept: dict[int, int]) -> None:
        """Go to the layout `new`: the ranks in `kept` (old rank -> new rank) keep their actor, every other is
        killed; the slots follow (`move_slots`)."""
        workers: list = [None] * new.world_size
        for rank, new_rank in kept.items():
            workers[new_rank], self.workers[rank] = self.workers[rank], None
        for rank in range(len(self.workers)):
            self.kill(rank)
        self.plan, self.workers = new, workers

    async def reserve(self, count: int) -> str | None:
        """Make sure `count` spare bundles exist, reserving a placement group for the missing ones; None when
        they do, else why not."""
        missing = count - sum(1 for slot in self.spare if placed(slot))
        if missing <= 0:
            return None
        pg = placement_group([dict(self.plan.gang.bundle) for _ in range(missing)], strategy="PACK",
                             name=f"{placement_group_name(self.job_id)}-grow{len(self.grown)}", lifetime="detached")
        try:
            await asyncio.wait_for(pg.ready(), GROW_RESERVE_S)
        except (TimeoutError, ray.exceptions.RayError):
            remove_placement_group(pg)
            return (f"the cluster has no free resources for {missing} more groups of {self.plan.gang.bundle} "
                    f"(waited {GROW_RESERVE_S:.0f} s)")
        self.grown.append(pg)
        self.spare += [(pg, i) for i in range(missing)]
        return None

    def move_slots(self, new: Plan) -> None:
        """Give the slots of the tensor-parallel groups `new` drops back, and take spare ones for those it adds;
        a grown placement group none of whose bundles is in use any more is given back to Ray."""
        keys = slot_keys(new)
        self.spare += [slot for key, slot in self.slots.items() if key not in keys]
        self.slots = {key: slot for key, slot in self.slots.items() if key in keys}
        self.spare.sort(key=lambda slot: not placed(slot))  # the bundles Ray has placed first
        for key in sorted(keys - set(self.slots)):
            self.slots[key] = self.spare.pop(0)
        for pg in list(self.grown):
            if all(p is not pg for p, _ in self.slots.values()):
                self.spare = [slot for slot in self.spare if slot[0] is not pg]
                self.grown.remove(pg)
                remove_placement_group(pg)

    def keep_replicas(self, replicas: list[int], new: Plan) -> None:
        """Go on with these data-parallel replicas (renumbered 0, 1, ...) as the layout `new`, their workers and
        bundles; the rest are killed and their bundles kept spare (Ray places them again if their node comes
        back)."""
        old, slots = self.plan, {}
        kept = {}
        for i, d in enumerate(replicas):
            for p in range(old.pp):
                slots[(p, i)] = self.slots.pop((p, d))
                for t in range(old.tp):
                    kept[old.rank_of(p, t, d)] = new.rank_of(p, t, i)
        self.spare += list(self.slots.values())
        self.slots = slots
        self.take(new, kept)

    def lost_replicas(self) -> set[int]:
        """The data-parallel replicas with a bundle Ray has not placed on a live node (its node is gone)."""
        alive = alive_nodes()
        return {dp for (_, dp), slot in self.slots.items() if not placed(slot, alive)}

    def nodes_of(self, replicas: set[int]) -> list[str]:
        """The nodes the ranks of these replicas ran on, as "id (address)", as last set up (none for a restarted
        coordinator's ranks, which it never set up)."""
        return sorted({f"{info['node_id']} ({info.get('node', '?')})" for info in self.ranks
                       if info.get("node_id") and self.plan.coords(info["rank"]).dp in replicas})

    def placed_spare(self) -> int:
        return sum(1 for slot in self.spare if placed(slot))

    def release(self) -> None:
        """Kill every rank (a peer blocked in a collective cannot outlive the job) and give back the placement
        groups reserved to grow. The service removes the admitted one."""
        for rank in range(len(self.workers)):
            self.kill(rank)
        self.workers = []
        self.kill_shards()
        for pg in self.grown:
            remove_placement_group(pg)
        self.grown, self.spare = [], []
