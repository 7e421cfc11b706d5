"""What a laid-out job will reach on a cluster of devices: `prediction.step_s`, `tokens_per_s_per_device`, `mfu`,
`hfu`, the memory per device against the device's capacity, and where the step's time goes (`breakdown`).

`predict_on_devices(config, cluster, machine)` costs a fixed layout with the cost model (`cost_model.step_costs`, the
machine a device profile's or a calibration's), simulates its schedule (`prediction.predict`), and splits the
simulated makespan into the computes (the re-run forwards of activation checkpointing apart), the bubble and the
pipeline hand-overs left exposed (the makespan simulated again with free hand-overs: what is left is the bubble).

MFU counts the model's FLOPs as Megatron does (6 N + 12 L d T a token: `ModelFamily.flops_per_token`, PaLM's
appendix B) against the device's dense bf16 peak; HFU adds the forwards re-run in backward that the cost model
charges (`cost_model.RECOMPUTE_EXTRA`: full recompute a whole forward, a third of the FLOPs more). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.parallel.config import JobConfig
from trainyard.parallel.models import family_of
from trainyard.parallel.plan.admission import ClusterResources
from trainyard.parallel.plan.memory.estimate import rank_memory
from trainyard.parallel.plan.planner.cost_model import RECOMPUTE_EXTRA, ratio_key
from trainyard.parallel.plan.planner.machine_costs import MachineCosts
from trainyard.parallel.plan.planner.planner_search import Search, _Sizing
from trainyard.parallel.plan.planner.prediction import Candidate, _simulated, predict
from trainyard.parallel.plan.rules import PlanError, violations
from trainyard.parallel.plan.sizing import fixed_parallel


@dataclass(frozen=True)
class DevicePrediction:
    """One layout's predicted step on a cluster of devices (`to_dict` is the CLI's `prediction`)."""

    step_s: float
    tokens_per_s_per_device: float
    mfu: float
    """Model FLOPs per second per device over the device's peak (0 where the peak is unknown)."""
    hfu: float
    """As mfu, with the re-run forwards of activation checkpointing counted."""
    memory_per_device: int
    """The largest rank's estimated peak (first, middle and last stage)."""
    device_memory: float
    """What one device holds (0: unknown)."""
    breakdown: dict[str, float]
    """Seconds per step by where they go; they add up to step_s."""
    world: int
    node_type: str

    @property
    def fits(self) -> bool:
        return not self.device_memory or self.memory_per_device <= self.device_memory

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s_per_device": self.tokens_per_s_per_device, "mfu": self.mfu,
                "hfu": self.hfu, "memory_per_device": self.memory_per_device, "device_memory": self.device_memory,
                "fits": self.fits, "world": self.world, "node_type": self.node_type, "breakdown": self.breakdown}


def predict_on_devices(config: JobConfig, cluster: ClusterResources, machine: MachineCosts) -> DevicePrediction:
    """The prediction of `config`'s own (fixed) layout, each rank on one device of `cluster`. Raises PlanError
    naming the first rule the layout breaks."""
    errors = violations(config)
    if errors:
        raise errors[0]
    search = Search(config, cluster, machine, margin=0.0)
    costs = search.costs(config)
    if costs is None:  # violations() said none: a layout the cost model cannot cost
        raise PlanError("parallel", "the layout cannot be costed")
    layout = search.layout(config)
    sizing = _Sizing(config, layout=layout)
    memory = max(rank_memory(sizing, layout.rank_of(stage, 0, 0)).resident(bool(layout.gpus_per_worker))
                 for stage in dict.fromkeys((0, layout.pp // 2, layout.pp - 1)))
    return describe(predict(layout, config, costs, memory), search)


def describe(cand: Candidate, search: Search) -> DevicePrediction:
    """A ranked layout's `Candidate` (the planner's winner, or one layout's) read as a device prediction, on the
    cluster and machine of `search`."""
    config, machine = cand.config, search.machine
    par, m = fixed_parallel(config), config.model
    costs = search.costs(config)
    if costs is None:
        raise PlanError("parallel", "the layout cannot be costed")
    layout = search.layout(config, with_schedule=False)
    terms = dict(cand.terms)
    chunks = par.microbatches * par.vpp
    recompute = chunks * costs.recompute_per_chunk
    bubble = terms.pop("bubble", 0.0)
    pp_exposed = 0.0
    if par.pp > 1 and costs.comm > 0:  # the makespan again with free hand-overs: the rest is the bubble
        f = max(costs.forward, 1e-12)
        free, _ = _simulated(par.schedule, par.pp, par.vpp, par.microbatches, ratio_key(costs.backward / f), 0.0,
                             tuple(map(ratio_key, costs.shared)))
        pp_exposed = min(max(bubble - max(free * f - chunks * (costs.forward + costs.backward), 0.0), 0.0), bubble)
    breakdown = {"compute": terms.pop("compute", 0.0) - recompute, "recompute": recompute,
                 "bubble": bubble - pp_exposed, "pp p2p": pp_exposed, **terms}
    world = layout.world_size
    tokens = config.global_batch * m.seq_len / cand.step_s / world
    flops = family_of(m).flops_per_token(m)
    mfu = tokens * flops / machine.peak_flops if machine.peak_flops else 0.0
    extra = RECOMPUTE_EXTRA.get(config.activation_checkpointing, 1.0)
    return DevicePrediction(step_s=cand.step_s, tokens_per_s_per_device=tokens, mfu=mfu, hfu=mfu * (1 + extra / 3),
                            memory_per_device=cand.memory_bytes, device_memory=search.rank_capacity(layout),
                            breakdown={k: v for k, v in breakdown.items() if v}, world=world,
                            node_type=machine.node_type)
