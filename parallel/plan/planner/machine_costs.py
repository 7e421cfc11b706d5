"""What a calibration measured on one node type, as the cost model reads it: `MachineCosts` (the FLOP rates by
width and by tokens, each collective's and the optimizer's `Fit` as latency + size / throughput, the trainer's
fixed costs, compute's and the collectives' slowdown with ranks sharing a node), its JSON form (the calibration
cache), and the costs a GPU node type is planned with before anyone measured it (`default_gpu_costs`).

Measured by `parallel.runtime.calibrate`, fitted and cached by `parallel.plan.planner.calibration`; turned into a
layout's step costs by `parallel.plan.planner.cost_model`. What is written by hand and why: `default_gpu_costs`' orders
of magnitude (H100-like) and a block's fixed cost there, OPS_PER_BLOCK kernels' latency, until a calibration runs on
that node type. Pure arithmetic: no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

OPS_PER_BLOCK = 16
"""Kernels (matmuls, norms, activations, adds) one block forward launches (forward and backward: 3x): the
fixed cost of a block on a node type not calibrated yet (`default_gpu_costs`)."""


@dataclass(frozen=True)
class Fit:
    """time = latency_s + size / per_s (size: bytes, FLOPs or elements; fitted by least squares)."""

    latency_s: float
    per_s: float

    def time(self, size: float) -> float:
        return self.latency_s + size / self.per_s if size > 0 else 0.0

    @staticmethod
    def fit(points: list[tuple[float, float]]) -> Fit:
        """Least squares of (size, seconds); latency clamped at 0, throughput at a positive value."""
        n = len(points)
        mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
        if slope <= 0:  # flat (noise): all latency, a throughput from the largest size
            x, y = max(points)
            return Fit(latency_s=max(my, 0.0), per_s=x / max(y, 1e-12) * 1e3)
        return Fit(latency_s=max(my - slope * mx, 0.0), per_s=1.0 / slope)


@dataclass(frozen=True)
class MachineCosts:
    """One node type's measured costs (`parallel.runtime.calibrate` measures them; JSON via to_dict/from_dict)."""

    node_type: str
    matmul: Fit
    """One matmul: latency + FLOPs / FLOP/s (one device, the thread count a rank gets)."""
    allreduce: Fit
    """An all-reduce of `world` ranks: latency + bytes / bytes/s."""
    p2p: Fit
    """One point-to-point message."""
    alltoall: Fit
    """An all-to-all of `world` ranks, by the bytes each rank holds."""
    optimizer: Fit
    """The optimizer step, by parameter elements."""
    world: int = 2
    """Ranks the collectives were measured with."""
    inter_node_factor: float = 1.0
    """Bandwidth between nodes / within one (a group spanning nodes is this much slower; 1: unmeasured)."""
    measured: dict = field(default_factory=dict)
    """The raw points each fit came from."""
    block_s: float = 0.0
    """Fixed seconds of one block's forward and backward for one micro-batch on one rank alone (Python, kernel
    launches, autograd: what a tiny model's step costs per block), beyond its FLOPs."""
    microbatch_s: float = 0.0
    """Fixed seconds of one chunk's forward and backward for one micro-batch beyond its blocks (the executor's
    actions, embedding, head and loss at no size)."""
    step_s: float = 0.0
    """Fixed seconds of a step beyond its micro-batches (zeroing, clipping, the optimizer's launch, the loss)."""
    tp_block_s: float = 0.0
    """Extra fixed seconds per block and micro-batch at tp > 1 (DTensor's per-op cost and its collectives'
    latency, as measured on a tiny model at tp = 2), beyond the collectives' bytes / bandwidth."""
    sp_block_s: float = 0.0
    """Extra fixed seconds per block and micro-batch of sequence parallelism on top of tp_block_s."""
    pp_microbatch_s: float = 0.0
    """Extra fixed seconds per chunk and micro-batch at pp > 1 (the executor's hand-overs and their waits, as
    measured on a tiny model at pp = 2), beyond the point-to-point messages' own time."""
    dp_step_s: float = 0.0
    """Extra fixed seconds per step at dp > 1 (the gradient reduction's buckets, hooks and waits for the peers,
    as measured on a tiny model at dp = 2), beyond the all-reduces' own time."""
    backward_share: float = 2 / 3
    """The part of the fixed costs spent in backward (the rest in forward)."""
    contention: tuple[float, ...] = ()
    """Compute's slowdown with k = 1, 2, ... ranks busy on one node at once (index k - 1), over one rank
    alone; () or past the end: 1 (each rank has its own device) or proportionally from the last."""
    allgather: Fit | None = None
    """An all-gather of `world` ranks, by the bytes gathered (the whole tensor); None (not measured): half an
    all-reduce's traffic."""
    reducescatter: Fit | None = None
    """A reduce-scatter of `world` ranks, by the bytes reduced (the whole tensor); None: as the all-gather."""
    token_efficiency: tuple[tuple[float, float], ...] = ()
    """(tokens per micro-batch, rate over the rate at the widths' token count) pairs, ascending: smaller
    micro-batches run their FLOPs slower (thinner matmuls); () or past the last: 1."""
    comm_contention: tuple[float, ...] = ()
    """An all-reduce's measured time with k = 1, 2, ... ranks of one node in it (index k - 1) over what the fit
    measured at `world` ranks predicts for k by its ring traffic (on shared CPU cores gloo's copies and wake-ups
    are CPU work that more ranks than cores wait on); () (not measured): as compute's slowdown."""
    model_flops: tuple[tuple[float, float], ...] = ()
    """(d_model, FLOP/s) pairs, widths ascending: the rate the trainer runs a model's FLOPs at on one rank alone,
    measured on models of a few widths (every kernel of a step: matmuls, attention, norms, autograd); () (not
    measured): the matmul's."""
    zero_fixed: dict[str, tuple[float, float]] = field(default_factory=dict)
    """A sharding level's extra fixed seconds over plain data parallelism, `str(zero)` -> (per block and step, per
    block and micro-batch), beyond its collectives' own time, as measured on tiny models at dp = 2 (FSDP2's
    hooks, copies and the optimizer's step on DTensors); a level not here: none."""

    peak_flops: float = 0.0
    """The device's dense bf16 peak (what MFU and HFU are counted against); 0: unknown (a CPU calibration)."""
    compile_speedup: float = 1.0
    """How much faster the model's FLOPs run under `compile: true` (fused non-matmul kernels); 1: not measured."""
    device_memory: float = 0.0
    """Bytes of one device's memory (a profile's HBM); 0: as the cluster reports."""
    nic_bytes_per_s: float = 0.0
    """One GPU's achieved bandwidth to other nodes (its own NIC on its rail); 0: across nodes is
    `inter_node_factor` x the node's own bandwidth."""
    node_gpus: int = 0
    """Devices a node holds (a profile's); 0: as the cluster says."""
    attention_flops_per_s: float = 0.0
    """The rate of attention's own FLOPs (scores and context: 12 L d T a token of training; a fused flash kernel,
    whatever the compile); 0: as the rest of the model's."""
    across_latency_s: float = 0.0
    """Latency of one hop between nodes (a collective spanning nodes pays it log2 of the nodes times, tree-like)."""

    def slowdown(self, ranks: int) -> float:
        """How much slower compute runs with `ranks` ranks on one node than with one (at least 1)."""
        if not self.contention or ranks <= 1:
            return 1.0
        if ranks <= len(self.contention):
            return max(self.contention[ranks - 1], 1.0)
        return max(self.contention[-1] * ranks / len(self.contention), 1.0)

    def flops_per_s(self, d_model: float, tokens: int = 0) -> float:
        """The rate a model `d_model` wide runs its FLOPs at, with `tokens` per micro-batch (0: as many as the
        widths were measured at): log-linear between the measured widths and token counts, the nearest beyond
        them; the matmul's when no width was measured."""
        if not self.model_flops:
            return self.matmul.per_s
        rate = _log_linear(self.model_flops, d_model)
        return rate * _log_linear(self.token_efficiency, tokens) if self.token_efficiency and tokens else rate

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> MachineCosts:
        fits: dict[str, Any] = {k: Fit(**d[k]) for k in ("matmul", "allreduce", "p2p", "alltoall", "optimizer")}
        fits |= {k: Fit(**d[k]) for k in ("allgather", "reducescatter") if d.get(k)}
        fixed = {k: d[k] for k in ("block_s", "microbatch_s", "step_s", "tp_block_s", "sp_block_s", "pp_microbatch_s",
                                   "dp_step_s", "backward_share", "peak_flops", "compile_speedup", "device_memory",
                                   "nic_bytes_per_s", "node_gpus", "across_latency_s", "attention_flops_per_s")
                 if k in d}
        zero_fixed = {level: (float(a), float(b)) for level, (a, b) in d.get("zero_fixed", {}).items()}
        model_flops = tuple((float(w), float(r)) for w, r in d.get("model_flops", ()))
        token_efficiency = tuple((float(t), float(e)) for t, e in d.get("token_efficiency", ()))
        if d.get("comm_contention"):
            fixed["comm_contention"] = tuple(d["comm_contention"])
        return MachineCosts(node_type=d["node_type"], world=d.get("world", 2),
                            inter_node_factor=d.get("inter_node_factor", 1.0), measured=d.get("measured", {}),
                            contention=tuple(d.get("contention", ())), zero_fixed=zero_fixed,
                            model_flops=model_flops, token_efficiency=token_efficiency, **fixed, **fits)

    def comm_share(self, ranks: int) -> float:
        """How much slower collectives run with `ranks` ranks on one node than at the world they were measured
        at: as measured (`comm_contention`), else on shared CPU cores as compute is (1 where each rank has its
        own device)."""
        measured = self.comm_contention
        if measured and ranks > self.world:
            at = measured[ranks - 1] if ranks <= len(measured) else measured[-1] * ranks / len(measured)
            return max(at, 1.0)
        return self.slowdown(ranks) / self.slowdown(self.world) if self.contention else 1.0

    def collective(self, kind: str, nbytes: float, n: int, spans_nodes: bool = False, per_node: int = 0) -> float:
        """One collective of `n` ranks over `nbytes` (a rank's whole tensor: the reduced, gathered or sent one),
        scaled from the measured world by the ring's traffic: all-reduce 2(n-1)/n, all-to-all, all-gather and
        reduce-scatter (n-1)/n. Spanning nodes with `per_node` of its ranks on each (0: one) where the NICs are
        known (`nic_bytes_per_s`): hierarchical, as NCCL runs it: the ring's bus bandwidth is the smaller of the
        node's and its ranks' NICs together (one rail each), and the latency adds a hop per doubling of nodes."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        gather = self.allgather if kind == "allgather" else self.reducescatter or self.allgather
        measured = {"allreduce": self.allreduce, "alltoall": self.alltoall}.get(kind, gather)
        base = measured or self.allreduce  # a gather or scatter not measured: from the all-reduce
        w = max(self.world, 2)
        traffic = {"allreduce": 2}.get(kind, 1)
        measured_traffic = (2 if kind == "allreduce" or measured is None else 1) * (w - 1) / w
        bus = base.per_s * measured_traffic
        if spans_nodes and self.nic_bytes_per_s > 0:
            k = max(per_node, 1)
            hops = math.ceil(math.log2(max(n / k, 2)))
            latency = base.latency_s * (min(k, w) - 1) / (w - 1) + 2 * hops * self.across_latency_s
            return latency + traffic * (n - 1) / n * nbytes / min(bus, k * self.nic_bytes_per_s)
        bus *= self.inter_node_factor if spans_nodes else 1.0
        return base.latency_s * (n - 1) / (w - 1) + traffic * (n - 1) / n * nbytes / bus


def _log_linear(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at x, log-linear between (x, y) points ascending in x; the nearest point's y beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            at = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + at * (math.log(y1) - math.log(y0)))
    return points[-1][1]


def default_gpu_costs(node_type: str = "unmeasured GPU") -> MachineCosts:
    """Costs to plan with before a calibration ran on a GPU node type (H100-like orders of magnitude)."""
    return MachineCosts(node_type=node_type, matmul=Fit(10e-6, 400e12), allreduce=Fit(30e-6, 150e9),
                        p2p=Fit(20e-6, 100e9), alltoall=Fit(30e-6, 100e9), optimizer=Fit(50e-6, 2e10),
                        world=8, inter_node_factor=0.15, block_s=3 * OPS_PER_BLOCK * 10e-6)
