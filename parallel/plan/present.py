"""The plan as plain data for the API and the CLI: `describe`, the memory plan and the simulated schedule.

Presentation only: nothing here decides anything; it reads a finished `Plan` (and the memory plan and the
schedule simulator). Byte counts are formatted by `parallel.plan.units`, which the CLI uses too. Pure: no torch.
"""

from __future__ import annotations

from typing import Any

from trainyard.parallel.plan import Plan
from trainyard.parallel.plan.memory.estimate import estimate, param_counts
from trainyard.parallel.plan.reduction_bytes import reduction_bytes
from trainyard.parallel.plan.schedule.actions import ActionKind, format_actions
from trainyard.parallel.plan.schedule.schedule_sim import render_gantt, simulate, steady_state
from trainyard.parallel.plan.schedule.schedule_timing import Costs
from trainyard.parallel.plan.schedule.schedules import build_schedule
from trainyard.parallel.plan.sync.replica_sync import cross_replica_bytes
from trainyard.parallel.plan.units import format_bytes


def describe(plan: Plan) -> dict:
    """The plan as plain data for the API and the CLI: degrees, rank map, groups, stages, schedule, resources."""
    layout = plan.layout  # asked directly: a plan of 65,536 ranks asks it hundreds of thousands of times
    model = plan.config.model
    return {
        "world_size": layout.world_size,
        "degrees": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp, "ep": layout.ep, "cp": layout.cp,
                    "vpp": layout.vpp},
        "microbatches": layout.microbatches,
        "micro_batch_size": layout.micro_batch_size,
        "ranks": [{"rank": c.rank, "pp": c.pp, "tp": c.tp, "dp": c.dp, "cp": c.cp, "ep": layout.ep_rank(c.rank),
                   "name": layout.worker_name(c.rank), "bundle": layout.bundle_of(c.rank),
                   "experts": list(layout.experts_of(c.rank))} for c in layout.ranks],
        "groups": {"dp": layout.dp_groups(), "pp": layout.pp_groups(), "tp": layout.tp_groups(),
                   "cp": layout.cp_groups() if layout.cp > 1 else [], "ep": layout.ep_groups(),
                   "experts": layout.expert_groups() if plan.config.model.moe else []},
        "model": {"family": model.family, "summary": plan.family.summary(model)},
        "moe_blocks": plan.config.model.moe_blocks,
        "stage_layers": [list(layers) for layers in plan.stage_layers],
        "schedule": describe_schedule(plan),
        "memory": describe_memory(plan),
        "reduction": reduction_bytes(plan),
        "chosen": ({"automatically": True, "predicted_step_s": plan.config.planned.predicted_step_s,
                    "node_type": plan.config.planned.node_type} if plan.config.planned else {"automatically": False}),
        "sync": describe_sync(plan),
        "resources": {
            "per_worker": {"CPU": plan.cpus_per_worker, "GPU": plan.gpus_per_worker},
            "bundles": plan.bundles(),
            "needed": plan.resources_needed(),
        },
    }


def describe_memory(plan: Plan) -> dict:
    """The memory plan (`parallel.plan.memory.estimate`), in bytes: each rank's parameters, gradients, optimizer state,
    peak activations, the recompute and loss transients, their total, and the rank with the largest total; `zero` is the
    sharding they were counted under (at 2 and 3, `params` is the shard plus `gathered`, what is gathered whole at the
    peak: ZeRO-2 every chunk, ZeRO-3 per block); `startup` the start-up peak, the parameter shards and `construction`,
    the one whole parameter construction draws at a time (the largest)."""
    ranks = estimate(plan.layout, plan.config)
    stages = {id(m): m.to_dict() for m in ranks}  # one RankMemory per stage, shared by its ranks
    per_rank = [{"rank": r, **stages[id(m)]} for r, m in enumerate(ranks)]
    zero, sharding = plan.parallel.zero, plan.sharding
    out: dict[str, Any] = {"zero": zero, "per_rank": per_rank, "largest": max(per_rank, key=lambda m: m["total"])}
    if sharding.shards_parameters:
        gathered = ("per block: the block computing and the next one being gathered (the embedding and the head are "
                    "units of their own)") if sharding.reshard_after_forward else \
            "every chunk of the rank, whole for the step"
        most = max(m["gathered"] for m in per_rank)
        out["note"] = (f"parallel.zero: {zero} (FSDP2): params are the 1/N shard kept between steps plus {gathered}, "
                       f"at most {format_bytes(most)} gathered at once on a rank; grads and optimizer are the 1/N "
                       "shards")
    return out


def describe_sync(plan: Plan) -> dict:
    """How the replicas keep in step (`parallel.sync`) and the bytes each rank all-reduces across them per step,
    on average (the payload: gradients every step, or parameters once per `every` steps), per pipeline stage."""
    sync, par = plan.parallel.sync, plan.parallel
    wire = 2 if par.reduce_dtype == "bf16" else 4
    per_stage = [cross_replica_bytes(sync, param_counts(plan, s).total, plan.dp, wire) for s in range(plan.pp)]
    return {"kind": sync.kind, **{option: getattr(sync, option) for option in plan.sync.options},
            "cross_replica_bytes_per_step": per_stage}


def describe_schedule(plan: Plan) -> dict:
    """The step's schedule, simulated with the spec's `sim_costs` before anything runs.

    `stages` holds each pipeline rank's actions in order (communication runs bracketed, see
    `parallel.plan.schedule.actions.format_actions`); `peak_activations` counts chunk activations per pipeline rank.
    """
    c = plan.config.sim_costs
    splits = any(a.kind is ActionKind.BACKWARD_WEIGHT for actions in plan.actions for a in actions)
    # W's share of the backward, shown where the schedule splits backwards (zb-h1, zbv)
    split = {"backward_weight": c.backward / 2 if c.backward_weight is None else c.backward_weight} if splits else {}
    result = simulate([list(actions) for actions in plan.actions], plan.microbatches, plan.vpp,
                      Costs(forward=c.forward, backward=c.backward, comm=c.comm, backward_weight=c.backward_weight),
                      plan.schedule.placement)
    makespan, bubble = result.makespan, result.bubble_fraction
    if not plan.schedule.flushes:  # 2bw: a step runs into the next; what it costs is the steady state's
        twice = build_schedule(plan.schedule.name, plan.pp, 2 * plan.microbatches, plan.vpp)
        makespan, bubble = steady_state([list(actions) for actions in plan.actions], twice, plan.microbatches,
                                        Costs(forward=c.forward, backward=c.backward, comm=c.comm))
    return {
        "kind": plan.schedule.name,
        "pp": plan.pp,
        "vpp": plan.vpp,
        "placement": plan.placement,  # which rank holds which virtual stage (`schedule.actions.virtual_stage`)
        "microbatches": plan.microbatches,
        "costs": {"forward": c.forward, "backward": c.backward, "comm": c.comm, **split},
        "stages": [format_actions(list(actions)) for actions in plan.actions],
        "makespan": makespan,  # of a step in steady state where the schedule does not flush (2bw)
        "bubble_fraction": bubble,
        "flushes": plan.schedule.flushes,
        "peak_activations": result.peak_activations,
        "gantt": render_gantt(result),
    }
