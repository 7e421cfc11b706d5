"""Device profiles: what a GPU node type is planned with before (or instead of) a calibration run on it.

A profile is data, one JSON file per device in `devices/` beside this module (`a100-80gb`, `h100-sxm`, `h200`,
`h100-96gb-500w`): dense bf16 and fp8 peak, HBM capacity and bandwidth, NVLink bandwidth, the network of a node
(GPUs per node, one NIC per GPU and its rate), the fraction of peak a matmul reaches by its inner width, the
attention kernel's fraction of peak, the non-matmul kernels' time over the matmuls' (eager and compiled), and each
collective's latency and bus bandwidth in a node and across nodes; every number carries the source it was read or
fitted from (`DeviceProfile.sources`). `load_profile(name)` reads one (a name of `devices/` or a path to a file of
the same shape); `DeviceProfile.machine_costs()` turns it into the `MachineCosts` the cost model reads, so a
calibration run on a real node replaces a profile field for field (a file of the same shape, or the calibration
cache's `MachineCosts`): the cost model never knows which it got.

What is written by hand and why: the AdamW step's bytes per element (fp32 parameter, gradient and two moments read,
three written: 28 bytes at 70% of HBM bandwidth) and a kernel's launch latency (OPS_PER_BLOCK kernels a block,
3 us each), which no datasheet gives. Pure: no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from trainyard.parallel.plan.planner.machine_costs import OPS_PER_BLOCK, Fit, MachineCosts

DEVICES = Path(__file__).resolve().parent / "devices"
"""Where the shipped profiles live, one `<name>.json` each."""
OPTIMIZER_BYTES_PER_ELEMENT = 28
"""AdamW's HBM traffic per parameter element (fp32 parameter, gradient, two moments read; parameter and moments
written)."""
OPTIMIZER_HBM_SHARE = 0.7
"""The share of HBM bandwidth a fused (foreach) optimizer step reaches."""
KERNEL_LATENCY_S = 3e-6
"""A kernel's launch and tail: a block's fixed cost is OPS_PER_BLOCK of them, three times (forward, backward)."""


class ProfileError(ValueError):
    """A profile name with no file, or a file missing a field (the message names which)."""


@dataclass(frozen=True)
class DeviceProfile:
    """One device's public figures and the fits made from published measurements (see the module docstring)."""

    name: str
    description: str
    peak_bf16: float
    """Dense bf16 tensor-core FLOP/s (what MFU and HFU are counted against)."""
    peak_fp8: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """One direction, one GPU to the NVSwitch."""
    gpus_per_node: int
    nic_bytes_per_s: float
    """One GPU's NIC, one direction, line rate."""
    matmul_efficiency: tuple[tuple[float, float], ...]
    """(inner width, fraction of peak) pairs, ascending: a GEMM of that width reaches that fraction."""
    attention_efficiency: float
    """The fraction of peak the attention kernel (flash attention, forward and backward) reaches."""
    kernel_overhead: dict[str, float]
    """`eager` / `compile` -> the non-matmul kernels' time over the matmuls' time."""
    allreduce_in_node: Fit
    """latency, bus bandwidth (nccl-tests' busbw) of an all-reduce over the node's NVSwitch."""
    p2p_in_node: Fit
    across_latency_s: float
    """Latency of one hop between nodes."""
    across_efficiency: float
    """Bus bandwidth across nodes over the NICs' line rate."""
    sources: dict[str, str] = field(default_factory=dict)
    """Field -> where its number comes from."""

    def efficiency(self, width: float) -> float:
        """The fraction of peak a matmul `width` wide reaches: log-linear between the points, flat beyond."""
        pts = self.matmul_efficiency
        if width <= pts[0][0]:
            return pts[0][1] * width / pts[0][0]  # narrower than measured: as the narrowest, scaled down
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if width <= x1:
                return y0 + (y1 - y0) * math.log(width / x0) / math.log(x1 / x0)
        return pts[-1][1]

    def machine_costs(self) -> MachineCosts:
        """The profile as the cost model's `MachineCosts` (each rank its own device: no contention)."""
        w = self.gpus_per_node
        busbw = self.allreduce_in_node.per_s
        eager = 1 + self.kernel_overhead.get("eager", 0.0)
        compiled = 1 + self.kernel_overhead.get("compile", self.kernel_overhead.get("eager", 0.0))
        widths = sorted({x for x, _ in self.matmul_efficiency} | {2 ** k for k in range(7, 16)})
        model_flops = tuple((float(x), self.peak_bf16 * self.efficiency(x) / eager) for x in widths)
        optimizer = Fit(50e-6, self.hbm_bytes_per_s * OPTIMIZER_HBM_SHARE / OPTIMIZER_BYTES_PER_ELEMENT)
        return MachineCosts(
            node_type=f"{self.name} x {w} a node", world=w,
            matmul=Fit(10e-6, self.peak_bf16 * self.matmul_efficiency[-1][1]),
            allreduce=Fit(self.allreduce_in_node.latency_s, busbw / (2 * (w - 1) / w)),
            alltoall=Fit(self.allreduce_in_node.latency_s, busbw / ((w - 1) / w)),
            p2p=self.p2p_in_node, optimizer=optimizer,
            inter_node_factor=min(w * self.nic_bytes_per_s * self.across_efficiency / busbw, 1.0),
            block_s=3 * OPS_PER_BLOCK * KERNEL_LATENCY_S, model_flops=model_flops,
            peak_flops=self.peak_bf16, compile_speedup=eager / compiled, device_memory=self.hbm_bytes,
            nic_bytes_per_s=self.nic_bytes_per_s * self.across_efficiency, node_gpus=w,
            across_latency_s=self.across_latency_s, attention_flops_per_s=self.peak_bf16 * self.attention_efficiency,
            measured={"profile": self.name, "sources": self.sources})


def profile_names() -> list[str]:
    return sorted(p.stem for p in DEVICES.glob("*.json"))


def load_profile(name: str) -> DeviceProfile:
    """A shipped profile by name, or a profile file by path (a calibration's replacement of one)."""
    path = Path(name)
    if not path.suffix:
        path = DEVICES / f"{name}.json"
    if not path.is_file():
        raise ProfileError(f"no device profile {name!r}; known: {', '.join(profile_names())}")
    return parse_profile(json.loads(path.read_text(encoding="utf-8")))


def parse_profile(d: dict) -> DeviceProfile:
    """A profile from its JSON form (values as {"value": x, "source": "..."} where the file gives a source)."""
    sources: dict[str, str] = {}

    def value(path: str) -> float:
        obj: object = d
        for part in path.split("."):
            if not isinstance(obj, dict) or part not in obj:
                raise ProfileError(f"device profile {d.get('name', '?')!r}: missing {path}")
            obj = obj[part]
        if isinstance(obj, dict):
            sources[path] = str(obj.get("source", ""))
            obj = obj.get("value")
        if not isinstance(obj, int | float):
            raise ProfileError(f"device profile {d.get('name', '?')!r}: {path} is not a number")
        return float(obj)

    def fit(path: str, bandwidth: str) -> Fit:
        part = d.get("collectives", {}).get(path)
        if not isinstance(part, dict):
            raise ProfileError(f"device profile {d.get('name', '?')!r}: missing collectives.{path}")
        sources[f"collectives.{path}"] = str(part.get("source", ""))
        return Fit(float(part["latency_s"]), float(part[bandwidth]))

    matmul = d.get("matmul_efficiency", {})
    points = tuple((float(x), float(y)) for x, y in matmul.get("points", ()))
    if not points:
        raise ProfileError(f"device profile {d.get('name', '?')!r}: missing matmul_efficiency.points")
    sources["matmul_efficiency"] = str(matmul.get("source", ""))
    overhead = {k: float(v) for k, v in d.get("kernel_overhead", {}).items() if k in ("eager", "compile")}
    sources["kernel_overhead"] = str(d.get("kernel_overhead", {}).get("source", ""))
    across = d.get("collectives", {}).get("across_nodes", {})
    sources["collectives.across_nodes"] = str(across.get("source", ""))
    return DeviceProfile(
        name=str(d.get("name", "")), description=str(d.get("description", "")),
        peak_bf16=value("peak_flops.bf16"), peak_fp8=value("peak_flops.fp8"), hbm_bytes=value("hbm.bytes"),
        hbm_bytes_per_s=value("hbm.bytes_per_s"), nvlink_bytes_per_s=value("nvlink.bytes_per_s"),
        gpus_per_node=int(value("network.gpus_per_node")), nic_bytes_per_s=value("network.nic_bytes_per_s"),
        matmul_efficiency=points, kernel_overhead=overhead, attention_efficiency=value("attention_efficiency"),
        allreduce_in_node=fit("allreduce_in_node", "bus_bytes_per_s"), p2p_in_node=fit("p2p_in_node", "bytes_per_s"),
        across_latency_s=float(across.get("latency_s", 20e-6)), across_efficiency=float(across.get("efficiency", 0.9)),
        sources=sources)
