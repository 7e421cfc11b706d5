"""When data-parallel replicas synchronise (`parallel.sync`: allreduce, local_sgd, diloco, gossip) and what it costs:
the pure rules the coordinator, the plan and the ranks all ask (`parallel.runtime.sync` runs the collective).

- `allreduce`: every gradient is summed across the replicas every step (the reducers); no sync step.
- `local_sgd` / `diloco`: each replica steps alone; every `every` steps (and after the last) they synchronise.
- `gossip`: as local_sgd, but a sync averages each replica with `peers` others only (`gossip_peers`), point to
  point; the syncs that must leave one model (after the last step, before a checkpoint: `whole_sync`) average
  them all, as local_sgd's do.
- `parameter_server`: the replicas push gradients to server shards and pull parameters (BSP, ASP, SSP); its pure
  rules are `parallel.plan.sync.parameter_server`.

`SYNC_KINDS` is the sync modes' pure side, by name: what the rules below read of a mode. How a mode runs on a rank
is `parallel.runtime.sync.SYNCS`, under the same names (tests/unit/test_sync.py holds the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.parallel.config import SyncConfig
from trainyard.parallel.names import SYNC_NAMES, SyncName, registry

FP32 = 4


@dataclass(frozen=True)
class SyncKind:
    """What the plan knows of one sync mode (`parallel.sync.kind`)."""

    steps_apart: bool
    """The replicas step alone between synchronisations (every `every` steps, and after the last), where they
    all-reduce their parameters (fp32); False: the reducers sum the gradients every step and nothing syncs."""
    options: tuple[str, ...] = ()
    """The `SyncConfig` fields the mode reads besides `kind` and `replicas` (`trainyard plan` shows them)."""
    peer_to_peer: bool = False
    """A sync sends this rank's parameters to each of `peers` peers (and receives theirs), point to point, instead
    of all-reducing them with every replica."""
    server: bool = False
    """The replicas (one dp rank each) push their gradients to server shards and pull the parameters back
    (`parallel.plan.sync.parameter_server`): nothing is summed across them, and the shards' clock counts a fixed
    set of them (no resize)."""


SYNC_KINDS: dict[SyncName, SyncKind] = registry(SYNC_NAMES, {
    "allreduce": SyncKind(steps_apart=False),
    "local_sgd": SyncKind(steps_apart=True, options=("every",)),
    "diloco": SyncKind(steps_apart=True, options=("every", "outer_lr", "outer_momentum")),
    "gossip": SyncKind(steps_apart=True, options=("every", "peers", "topology"), peer_to_peer=True),
    "parameter_server": SyncKind(steps_apart=False, options=("consistency", "staleness", "shards"), server=True),
}, "the replica sync modes' facts")
"""The sync modes by name (the spec's `parallel.sync.kind`); `allreduce` is the default."""
NAMES = tuple(SYNC_KINDS)
LOCAL_KINDS = tuple(name for name, kind in SYNC_KINDS.items() if kind.steps_apart)
"""The kinds whose replicas step apart between synchronisations."""


def is_local(cfg: SyncConfig) -> bool:
    return SYNC_KINDS[cfg.kind].steps_apart


def replica_dp(cfg: SyncConfig, dp: int) -> int:
    """Data-parallel ranks in one replica, which sum their gradients every step (and share ZeRO's shards and MoE's
    experts): every dp rank with allreduce (one replica), dp / `replicas` with the others (default 1; a parameter
    server's replicas are one rank each)."""
    return dp // (cfg.replicas or dp) if is_local(cfg) or SYNC_KINDS[cfg.kind].server else dp


def resize_refusal(cfg: SyncConfig) -> str | None:
    """Why a job of this sync mode cannot change its dp (None: it can)."""
    if is_local(cfg):
        return ("a resize copies one replica's state to the others, and these replicas differ between "
                "synchronisations")
    if SYNC_KINDS[cfg.kind].server:
        return "the server shards' clock counts a fixed set of replicas"
    return None


def layout_replica_dp(cfg: SyncConfig, dp: int) -> int:
    """`Layout.replica_dp`: the data-parallel ranks of one replica where they are fewer than dp (local_sgd, diloco
    replicas of dp / `replicas` ranks), else 0 (every dp rank)."""
    in_replica = replica_dp(cfg, dp)
    return in_replica if in_replica < dp else 0


def syncs_after(step: int, cfg: SyncConfig, steps: int) -> bool:
    """Whether the replicas synchronise their parameters after step `step` (0-based): every `every` steps, and
    after the job's last step (so the final state, and every checkpoint, is one model)."""
    return is_local(cfg) and ((step + 1) % cfg.every == 0 or step + 1 == steps)


def whole_sync(step: int, cfg: SyncConfig, checkpoint_every: int, steps: int) -> bool:
    """Whether the sync after `step` must leave every replica with one model: after the job's last step, and
    where a `checkpoint.every` checkpoint follows (which holds one copy of the state). local_sgd's and diloco's
    always do; gossip's average each replica with its peers only, but for these."""
    return not SYNC_KINDS[cfg.kind].peer_to_peer or step + 1 == steps or \
        averages_optimizer_state(step, cfg, checkpoint_every, steps)


def rejoin_step(after: int, cfg: SyncConfig, steps: int) -> int:
    """The step whose sync a replica dropped before step `after` (the survivors' next step) rejoins at: the
    first sync at or after it (the last step always syncs)."""
    return next(s for s in range(after, steps) if syncs_after(s, cfg, steps))


def round_of(step: int, dp: int, dropped: dict[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Who takes part in `step` while replicas are dropped (`dropped`: replica -> its `rejoin_step`): the live
    replicas (they step) and those rejoining at this step's sync; None when every replica steps (a whole
    round). A dropped replica neither steps nor syncs before its rejoin step, and steps again after it."""
    out = {d: at for d, at in dropped.items() if at >= step}
    if not out:
        return None
    return tuple(d for d in range(dp) if d not in out), tuple(sorted(d for d, at in out.items() if at == step))


def averages_optimizer_state(step: int, cfg: SyncConfig, checkpoint_every: int, steps: int) -> bool:
    """Whether the sync after `step` also averages the replicas' inner optimizer state: a `checkpoint_every`
    checkpoint follows it, from which a resumed run must follow the uninterrupted one (not the final one)."""
    done = step + 1
    return syncs_after(step, cfg, steps) and checkpoint_every > 0 and done % checkpoint_every == 0 and done < steps


def syncs_before_save(steps_done: int, cfg: SyncConfig, steps: int) -> bool:
    """Whether a checkpoint of the state after `steps_done` steps outside the schedule (a stop, a resize through a
    checkpoint) must first synchronise the replicas' parameters: they step apart and last synced before it."""
    return is_local(cfg) and steps_done > 0 and not syncs_after(steps_done - 1, cfg, steps)


def cross_replica_bytes(cfg: SyncConfig, local_params: int, dp: int, wire_bytes: int = FP32) -> float:
    """Bytes one rank puts into its all-reduces across the replicas per step, on average (the payload; a ring
    all-reduce sends about twice that over the wire). allreduce: every local gradient, at the wire type
    (`parallel.reduce_dtype`), each step; local_sgd and diloco: every local parameter (fp32) once per `every`
    steps; gossip: to each of `peers` peers once per `every` steps (but at a `whole_sync`, one all-reduce's).
    0 with one replica."""
    if dp == 1:
        return 0.0
    if is_local(cfg):
        copies = cfg.peers if SYNC_KINDS[cfg.kind].peer_to_peer else 1
        return FP32 * local_params * copies / cfg.every
    return float(wire_bytes * local_params)
