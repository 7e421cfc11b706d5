"""Bench section `predictions`: the planner's predictions beside published figures of large runs, each with its
source.

Each published run is one `Published` below: the model and layout as the run's authors give them, the device
profile of its GPUs (`parallel/plan/planner/devices/`), and its published throughput. The row's `ours` is the
cost model's tokens/s per device for that layout on that cluster (`trainyard plan --device`), `baseline` the
published one (Megatron's MFU read back into tokens/s with Megatron's own FLOP count, 6 N + 12 L d T a token, at
A100's 312 TFLOP/s), and the target is within 15% of it. A second row per run says what `--auto` picks on the
same cluster and its prediction over the published layout's. No GPU runs here: pure arithmetic, in seconds.

Sources:
- torchtitan: `benchmarks/llama3_h100_202412_torchtitan.md` in pytorch/torchtitan (Tables 1 and 3: Llama 3.1 8B,
  FSDP, local batch 2 x 8192, selective activation checkpointing, bf16; 8 and 128 H100s at 500 W with HBM2e).
- Megatron-LM: its README's table of GPT models from 22B to 1T on A100s, from Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", Table 5 (sequence parallelism + selective recompute,
  seq 2048, vocab 51200, micro-batch 1; MFU and HFU) with each run's tp, pp, dp and batch from its Table 3.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bench.context import BenchContext
from bench.results import Row, at_most, ratio, ratio_within

A100_PEAK = 312e12
TARGET = 0.15


@dataclass(frozen=True)
class Published:
    name: str
    device: str
    nodes: int
    model: dict
    parallel: dict
    global_batch: int
    tokens_per_s_per_device: float
    source: str
    compile: bool = False
    """Megatron-LM's runs: True (its fused kernels do what compile's fusion does)."""
    activation_checkpointing: str = "selective"
    leaves_out: str = ""
    """What the cost model leaves out that this run depends on (said beside a miss)."""

    def spec(self, parallel: dict | str | None = None) -> dict:
        return {"name": self.name, "model": self.model, "steps": 1, "global_batch": self.global_batch,
                "precision": "bf16", "activation_checkpointing": self.activation_checkpointing,
                "compile": self.compile, "data": {"kind": "synthetic"},
                "parallel": self.parallel if parallel is None else parallel}


LLAMA_8B = {"family": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "d_model": 4096, "ffn_hidden": 14336,
            "vocab_size": 128256, "seq_len": 8192, "rope_theta": 500000.0}


def _gpt(n_layer: int, n_head: int, d_model: int) -> dict:
    return {"family": "gpt2", "n_layer": n_layer, "n_head": n_head, "d_model": d_model, "vocab_size": 51200,
            "seq_len": 2048}


def _megatron_tps(mfu: float, model: dict) -> float:
    """Megatron's MFU read back as tokens/s per GPU: MFU x peak / (72 l h^2 + 12 l h s + 6 V h)."""
    layers, h, s, v = model["n_layer"], model["d_model"], model["seq_len"], model["vocab_size"]
    return mfu * A100_PEAK / (72 * layers * h * h + 12 * layers * h * s + 6 * v * h)


TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
MEGATRON = "Megatron-LM README (Korthikanti et al. 2022, Table 5)"
PUBLISHED = (
    Published("torchtitan llama3.1-8b 8xH100 fsdp", "h100-96gb-500w", 1, LLAMA_8B,
              {"dp": 8, "zero": 3, "microbatches": 1}, 16, 5762, f"{TITAN}, Table 1: FSDP, 5,762 TPS/GPU",
              leaves_out="torchtitan's selective op checkpointing (every other matmul re-run; trainyard's "
                         "selective re-runs less)"),
    Published("torchtitan llama3.1-8b 8xH100 fsdp+compile", "h100-96gb-500w", 1, LLAMA_8B,
              {"dp": 8, "zero": 3, "microbatches": 1}, 16, 6667, f"{TITAN}, Table 1: FSDP + torch.compile, 6,667",
              compile=True, leaves_out="as above"),
    Published("torchtitan llama3.1-8b 128xH100 fsdp", "h100-96gb-500w", 16, LLAMA_8B,
              {"dp": 128, "zero": 3, "microbatches": 1}, 256, 5605, f"{TITAN}, Table 3: FSDP, 5,605 TPS/GPU",
              leaves_out="as above; contention between the 16 nodes' rails at the top-of-rack switches"),
    Published("torchtitan llama3.1-8b 128xH100 fsdp+compile", "h100-96gb-500w", 16, LLAMA_8B,
              {"dp": 128, "zero": 3, "microbatches": 1}, 256, 6514, f"{TITAN}, Table 3: FSDP + torch.compile, 6,514",
              compile=True, leaves_out="as above"),
    Published("megatron gpt-22b 8xA100 tp8", "a100-80gb", 1, _gpt(48, 64, 6144),
              {"tp": 8, "sp": True, "microbatches": 4}, 4, _megatron_tps(0.415, _gpt(48, 64, 6144)),
              f"{MEGATRON}: 22B, tp 8 pp 1, 8 GPUs, batch 4, MFU 41.5% HFU 43.7%", compile=True,
              leaves_out="Megatron's fused kernels (bias-GeLU, bias-dropout-add, softmax) and its tp all-reduces "
                         "overlapped with the weight-gradient GEMMs in backward"),
    Published("megatron gpt-175b 64xA100 tp8 pp8", "a100-80gb", 8, _gpt(96, 96, 12288),
              {"tp": 8, "pp": 8, "sp": True, "microbatches": 64, "schedule": "1f1b"}, 64,
              _megatron_tps(0.514, _gpt(96, 96, 12288)),
              f"{MEGATRON}: 175B, tp 8 pp 8, 64 GPUs, batch 64, MFU 51.4% HFU 52.8%", compile=True,
              leaves_out="as the 22B row, and the p2p overlapped with compute in steady 1F1B"),
    Published("megatron gpt-530b 280xA100 tp8 pp35", "a100-80gb", 35, _gpt(105, 128, 20480),
              {"tp": 8, "pp": 35, "sp": True, "microbatches": 280, "schedule": "1f1b"}, 280,
              _megatron_tps(0.56, _gpt(105, 128, 20480)),
              f"{MEGATRON}: 530B, tp 8 pp 35, 280 GPUs, batch 280, MFU 56.0% HFU 57.0%", compile=True,
              leaves_out="as the 175B row"),
    Published("megatron gpt-1t 512xA100 tp8 pp64", "a100-80gb", 64, _gpt(128, 160, 25600),
              {"tp": 8, "pp": 64, "sp": True, "microbatches": 512, "schedule": "1f1b"}, 512,
              _megatron_tps(0.563, _gpt(128, 160, 25600)),
              f"{MEGATRON}: 1T, tp 8 pp 64, 512 GPUs, batch 512, MFU 56.3% HFU 57.0%", compile=True,
              leaves_out="as the 175B row"),
)


def predict(run: Published, auto: bool = False) -> dict:
    """The CLI's `prediction` (and with `auto`, the planner's pick) for a published run, in-process."""
    from trainyard.api.spec import parse_submitted_spec
    from trainyard.parallel.plan.planner.device_plan import plan_on_devices

    config = parse_submitted_spec(run.spec("auto" if auto else None))
    return plan_on_devices(config, nodes=run.nodes, gpus_per_node=8, device=run.device)[1]


def not_faster(fixed: dict, bounds: str) -> str:
    """Why --auto's layout is predicted slower than the published one."""
    if not fixed["fits"]:
        return (f"; the published layout does not fit trainyard's memory plan ({fixed['memory_per_device'] / 2**30:.0f}"
                f" GiB of {fixed['device_memory'] / 2**30:.0f}): --auto's is the fastest found that does")
    return f"; the published layout is predicted faster: the search leaves it out ({bounds})"


def run_section(ctx: BenchContext) -> list[Row]:
    rows: list[Row] = []
    for run in PUBLISHED:
        t0 = time.perf_counter()
        fixed = predict(run)["prediction"]
        ours = fixed["tokens_per_s_per_device"]
        share = ", ".join(f"{k} {v / fixed['step_s']:.0%}" for k, v in fixed["breakdown"].items()
                          if v / fixed["step_s"] >= 0.01)
        r = ratio(ours, run.tokens_per_s_per_device)
        miss = "" if r is not None and abs(r - 1) <= TARGET else f"; a miss: the model leaves out {run.leaves_out}"
        rows.append(Row(f"{run.name}: tokens/s per device, predicted vs published", round(ours, 1),
                        round(run.tokens_per_s_per_device, 1), r and round(r, 3), "tok/s",
                        f"{run.source}; predicted step {fixed['step_s']:.3g} s, MFU {fixed['mfu']:.1%}, "
                        f"HFU {fixed['hfu']:.1%}, memory {fixed['memory_per_device'] / 2**30:.1f} GiB of "
                        f"{fixed['device_memory'] / 2**30:.0f}; time: {share}{miss}", target=ratio_within(TARGET)))
        picked = predict(run, auto=True)
        best = picked["prediction"]
        lay = picked["planner"]["candidates"][0]["layout"]
        text = " ".join(f"{k.rpartition('.')[2]}={v}" for k, v in lay.items())
        faster = best["step_s"] <= fixed["step_s"] * (1 + 1e-9)
        rows.append(Row(f"{run.name}: --auto's layout, predicted step vs the published layout's",
                        round(best["step_s"], 4), round(fixed["step_s"], 4),
                        round(best["step_s"] / fixed["step_s"], 3), "s",
                        f"--auto picked {text} ({picked['planner']['evaluated']} layouts costed, "
                        f"{time.perf_counter() - t0:.1f} s with the fixed one)"
                        + ("" if faster else not_faster(fixed, picked["planner"]["bounds"])),
                        target=None))
        print(f"  {rows[-2].name}: {ours:.0f} vs {run.tokens_per_s_per_device:.0f} ({r:.2f}); auto {text}",
              flush=True)
    return [*rows, plan_1t_on_3072()]


def plan_1t_on_3072() -> Row:
    """`trainyard plan --auto` of a 1T GPT (Megatron's shape) on 384 nodes of 8 A100s, timed in-process."""
    from trainyard.api.spec import parse_submitted_spec
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.plan.planner.device_plan import plan_on_devices

    run = PUBLISHED[-1]
    t0 = time.perf_counter()
    config = parse_submitted_spec({**run.spec("auto"), "global_batch": 3072})
    chosen, out = plan_on_devices(config, nodes=384, gpus_per_node=8, device="a100-80gb")
    make_plan(chosen)
    took = time.perf_counter() - t0
    lay = out["planner"]["candidates"][0]["layout"]
    text = " ".join(f"{k.rpartition('.')[2]}={v}" for k, v in lay.items())
    p = out["prediction"]
    return Row("--auto for a 1T GPT on 3072 A100s (384 nodes): planning wall time", round(took, 2), None, None, "s",
               f"picked {text}: predicted step {p['step_s']:.3g} s, MFU {p['mfu']:.1%}, memory "
               f"{p['memory_per_device'] / 2**30:.1f} GiB of 80; {out['planner']['enumerated']} base layouts, "
               f"{out['planner']['evaluated']} costed; bounds: {out['planner']['bounds']}", target=at_most(30))
