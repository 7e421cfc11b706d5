"""`python -m bench.gpu_smoke [--device cuda]`: one rank of each kind of job the project has, on one device with
torch alone (NCCL on CUDA, gloo on CPU): each variant trains 4 steps straight, then again as 3 steps, a DCP
checkpoint, a fresh rank that loads it and the 4th step (the losses must be equal); the checkpoint is exported
(trainyard's file and a Hugging Face directory). On CUDA each variant's losses are compared with the same run on
the CPU (fp32: within 1e-3 relative; TF32 off) or with its fp32 twin (bf16: within 5e-2). Prints a line a variant
and exits 1 if any failed: what broke on the device and not on the CPU is a defect."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file
from trainyard.parallel.config import (
    DataConfig,
    JobConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    ResourcesConfig,
)
from trainyard.parallel.io.checkpoint import step_dir
from trainyard.parallel.io.export import export_model
from trainyard.parallel.io.hf_checkpoint import write_hf_dir
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.driver import RankDriver, Save
from trainyard.parallel.runtime.local_world import free_ports

STEPS = 4
GPT2 = ModelConfig(n_layer=2, n_head=4, d_model=128, vocab_size=512, seq_len=128)
LLAMA = ModelConfig(family="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=128, vocab_size=512, seq_len=128)
VARIANTS: dict[str, dict] = {
    "gpt2 fp32": {"model": GPT2},
    "gpt2 bf16 selective recompute": {"model": GPT2, "precision": "bf16", "activation_checkpointing": "selective"},
    "gpt2 full recompute, optimizer and activation offload": {
        "model": GPT2, "activation_checkpointing": "full", "activation_offload": True,
        "optimizer": OptimizerConfig(offload=True)},
    "gpt2 adafactor": {"model": GPT2, "optimizer": OptimizerConfig(kind="adafactor", lr=0.05)},
    "gpt2 compile": {"model": GPT2, "compile": True},
    "llama gqa fp32": {"model": LLAMA},
    "llama gqa bf16": {"model": LLAMA, "precision": "bf16"},
    "llama moe (ep 1) fp32": {"model": dataclasses.replace(LLAMA, moe=MoEConfig(experts=4, top_k=2, every=1))},
}
BF16_TWIN = {"gpt2 bf16 selective recompute": "gpt2 fp32", "llama gqa bf16": "llama gqa fp32"}


def config(name: str, device: torch.device) -> JobConfig:
    return JobConfig(name="gpu-smoke", steps=STEPS, data=DataConfig(kind="synthetic"), global_batch=4,
                     parallel=ParallelConfig(), seed=7,
                     resources=ResourcesConfig(gpus_per_worker=1 if device.type == "cuda" else 0), **VARIANTS[name])


def run(name: str, device: torch.device, where: Path) -> list[float]:
    """The variant's 4 losses, after checking that a resumed 4th step equals the straight one and exporting."""
    plan = make_plan(config(name, device))

    def new_rank() -> RankDriver:
        return RankDriver(plan, 0, "127.0.0.1", free_ports(1)[0], device, 300.0)

    driver = new_rank()
    straight = [s["loss"] for s in driver.run(range(STEPS))]
    driver.close()
    driver = new_rank()
    driver.run(range(STEPS - 1), save_after=(STEPS - 1,), save=Save(where / "ckpt", {"job": name}))
    driver.close()
    driver = new_rank()
    checkpoint = step_dir(where / "ckpt", STEPS - 1)
    driver.load(checkpoint, STEPS - 1)
    resumed = driver.step(STEPS - 1)["loss"]
    driver.close()
    assert resumed == straight[-1], f"resumed step {STEPS - 1}: loss {resumed} != {straight[-1]}"
    exported = export_model(plan.config, checkpoint, STEPS - 1, where / "model.safetensors")
    write_hf_dir(where / "hf", plan.config.model, load_file(str(exported)))  # export_hf's work (it reads the
    # file's config with pydantic, which a device image may lack)
    assert all(math.isfinite(x) for x in straight), straight
    return straight


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", nargs="*", help="variant names (default: all)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    names = args.only or list(VARIANTS)
    results: dict[str, list[float]] = {}
    failed = 0
    for name in names:
        try:
            with tempfile.TemporaryDirectory() as d:
                results[name] = losses = run(name, device, Path(d))
            line = f"ok    {name}: losses {[round(x, 5) for x in losses]}; resume equal; exported"
            if device.type == "cuda" and name in BF16_TWIN and BF16_TWIN[name] in results:
                twin = results[BF16_TWIN[name]]
                worst = max(abs(a - b) / abs(b) for a, b in zip(losses, twin, strict=True))
                assert worst < 5e-2, f"bf16 vs fp32: {worst:.2e}"
                line += f"; vs fp32 {worst:.1e}"
            elif device.type == "cuda" and name not in BF16_TWIN:
                with tempfile.TemporaryDirectory() as d:
                    cpu = run(name, torch.device("cpu"), Path(d))
                worst = max(abs(a - b) / abs(b) for a, b in zip(losses, cpu, strict=True))
                assert worst < 1e-3, f"cuda vs cpu: {worst:.2e} ({losses} vs {cpu})"
                line += f"; vs cpu {worst:.1e}"
            print(line, flush=True)
        except Exception:  # noqa: BLE001 - a smoke run reports every variant
            failed += 1
            print(f"FAIL  {name}:\n{traceback.format_exc()}", flush=True)
    print(f"{len(names) - failed} of {len(names)} variants passed on {device}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
