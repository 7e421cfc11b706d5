"""`python -m bench.gpu`: trainyard's own trainer on one GPU against a plain PyTorch loop of the same GPT.

Runs with torch alone (no Ray, no service), in one process, on one device:
- trainyard: `parallel`'s trainer at world size 1, exactly as a worker runs it: `init_distributed` (NCCL on
  CUDA, gloo on CPU), `RankTrainer`, `train_step(step, micro-batch ids)`. Each step reads its samples from the
  job's (synthetic) dataset on the CPU and copies them to the device, as a worker does; the sample ids come
  ready-made, as a worker gets them from the coordinator.
- plain: the same model (`parallel.model.full_model`, same init), the same samples of the same steps
  already on the device, autocast around forward and loss (when bf16), mean `F.cross_entropy`, backward,
  `clip_grad_norm_` at the spec's grad_clip, and `torch.optim.AdamW(foreach=True)` with the trainer's
  groups (weight decay on matrices and embeddings only) and learning-rate schedule (`parallel.optim.lr_at`).
  No host synchronisation inside a step.
Both sides take the same steps (the same data and learning rate at each index), so their losses match step
by step (exactly in fp32 up to summation order; bf16 drifts): the harness reports the largest difference, a
check that both sides do the same work.

Method: warm-up steps of each side first (not timed), then `--rounds` rounds; a round times a block of
`--steps` steps of each side, the order alternating (trainyard first in odd rounds), each block between two
device synchronisations, so drift of the machine hits both. Reported: the median over rounds of each side's
tokens/s, their ratio (trainyard / plain; target >= 0.97) and each side's MFU (target >= 45% on an H100):

    MFU = FLOPs per token x tokens/s / peak bf16 FLOP/s,   FLOPs per token = 6 N + 12 L d T

(PaLM appendix B, nanoGPT's `estimate_mfu`), N the parameters that take part in matrix products (all but
the token and position embedding tables, which are lookups), L layers, d d_model, T seq_len; the attention
term counts the whole T x T score matrix, as both sources do, though causal attention computes about half.

    python -m bench.gpu --out gpu.json                # GPU: ~406M-parameter GPT, bf16, batch 16 x 1024
    python -m bench.gpu --tiny --device cpu --steps 3 # seconds on a CPU: checks the code path, no numbers

Never run in CI (`tests/integration/test_gpu_bench.py` runs only the tiny CPU mode, without timing claims).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from parallel.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, ResourcesConfig
from parallel.data import global_batch_ids, load_batch, open_dataset, rank_share
from parallel.distributed import init_distributed, shutdown_distributed
from parallel.model import GPTStage, full_model
from parallel.optim import lr_at
from parallel.plan import Plan, PlanError, make_plan
from parallel.trainer import RankTrainer

GPT_MEDIUM = {"n_layer": 24, "n_head": 16, "d_model": 1024, "vocab_size": 50304, "seq_len": 1024}
TINY = {"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 256, "seq_len": 32}
TARGET_RATIO = 0.97
TARGET_MFU = 0.45
# Dense bf16 tensor-core peaks (datasheets, without sparsity), matched in order against the device's name.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200 NVL", 835.0),
                    ("H200", 989.4), ("A100", 312.0))
DIST_TIMEOUT_S = 300.0


@dataclass
class Side:
    """One way of training: `step(i)` queues training step i on the device; `losses()` reads them back."""

    name: str
    step: Callable[[int], None]
    losses: Callable[[], list[float]]


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; use --device cpu (with --tiny) to check the code path")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for what stays fp32 (both sides: process-wide)
    else:
        torch.set_num_threads(args.threads)
    plan = _plan(args, device, precision)
    cfg = plan.config
    total_steps = cfg.steps
    shares = _shares(plan)
    plain_model = full_model(cfg.model, cfg.seed).to(device)
    counts = _param_counts(plain_model)
    flops_per_token = 6 * counts["matmul"] + 12 * cfg.model.n_layer * cfg.model.d_model * cfg.model.seq_len
    peak = args.peak_tflops if args.peak_tflops is not None else _peak_tflops(device)
    tokens_per_step = cfg.global_batch * cfg.model.seq_len
    print(_header(cfg, plan, device, precision, counts, flops_per_token, peak, args), flush=True)

    ours = _trainyard_side(plan, device, shares, compile_blocks=args.compile)
    try:
        plain = _plain_side(cfg, plain_model, device, precision, shares, compile_blocks=args.compile)
        sides = (ours, plain)
        for side in sides:  # warm-up: allocator, kernels' autotuning, compilation
            for step in range(args.warmup):
                side.step(step)
            _sync(device)
        times: dict[str, list[float]] = {s.name: [] for s in sides}
        for r in range(args.rounds):
            steps = range(args.warmup + r * args.steps, args.warmup + (r + 1) * args.steps)
            for side in sides if r % 2 == 0 else sides[::-1]:
                times[side.name].append(_timed(side, steps, device))
            rates = (f"{name} {args.steps * tokens_per_step / t[-1]:,.0f} tokens/s" for name, t in times.items())
            print(f"round {r + 1}/{args.rounds}: {', '.join(rates)}", flush=True)
        losses = {s.name: s.losses() for s in sides}
        load_ms = _batch_load_ms(cfg, device, shares[:5])
    finally:
        shutdown_distributed()
    result = _result(cfg, plan, device, precision, args, counts, flops_per_token, peak, times, losses, load_ms,
                     total_steps)
    print(_summary(result), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"result written to {args.out}")
    return result


def _plan(args: argparse.Namespace, device: torch.device, precision: str) -> Plan:
    shape = TINY if args.tiny else GPT_MEDIUM
    batch = args.batch if args.batch is not None else (4 if args.tiny else 16)
    cfg = JobConfig(
        name="bench-gpu", model=ModelConfig(**shape), steps=args.warmup + args.rounds * args.steps,
        data=DataConfig(kind="synthetic"), global_batch=batch, precision=precision,
        parallel=ParallelConfig(microbatches=args.microbatches),
        resources=ResourcesConfig(gpus_per_worker=1 if device.type == "cuda" else 0),
    )
    try:
        return make_plan(cfg)
    except PlanError as e:
        raise SystemExit(f"trainyard's plan refuses this job: {e}" + (
            " (until bf16 lands in the trainer, run with --precision fp32)" if e.field == "precision" else "")) from e


def _shares(plan: Plan) -> list[list[list[int]]]:
    """The sample ids of each step's micro-batches, computed up front: a worker gets them from the coordinator."""
    cfg = plan.config
    num_samples = open_dataset(cfg).num_samples
    return [rank_share(global_batch_ids(cfg.seed, step, cfg.global_batch, num_samples), 0, 1, plan.microbatches)
            for step in range(cfg.steps)]


def _trainyard_side(plan: Plan, device: torch.device, shares: list[list[list[int]]], *, compile_blocks: bool) -> Side:
    groups = init_distributed(plan, 0, "127.0.0.1", _free_port(), device, DIST_TIMEOUT_S)
    trainer = RankTrainer(plan, 0, groups, device)
    if compile_blocks:
        for chunk in trainer.chunks:
            _compile_blocks(chunk)
    losses: list[float] = []

    def step(i: int) -> None:
        stats = trainer.train_step(i, shares[i])  # synchronises: it returns the loss and grad norm as floats
        losses.append(stats.loss)

    return Side("trainyard", step, lambda: list(losses))


def _plain_side(cfg: JobConfig, model: GPTStage, device: torch.device, precision: str,
                shares: list[list[list[int]]], *, compile_blocks: bool) -> Side:
    """The textbook loop. Its batches are loaded and put on the device before any timing."""
    dataset = open_dataset(cfg)
    batches = [[tuple(t.to(device) for t in load_batch(dataset, ids)) for ids in step] for step in shares]
    if compile_blocks:
        _compile_blocks(model)
    params = list(model.parameters())
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=opt.lr, betas=(opt.beta1, opt.beta2), foreach=True)

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    pending: list[torch.Tensor] = []

    def step(i: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(i, opt, cfg.steps)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for inputs, targets in batches[i]:
            with autocast():
                logits = model.lm_head(model.ln_f(model(inputs)))
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / len(batches[i])
            loss.backward()
            total += loss.detach()
        if opt.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, opt.grad_clip, foreach=True)
        optimizer.step()
        pending.append(total)

    return Side("plain", step, lambda: [float(t) for t in pending])


def _compile_blocks(stage: GPTStage) -> None:
    """`torch.compile` each transformer block in place (parameter names unchanged): the same on both sides,
    and it leaves the trainer's own step (pipeline executor, loss, gradient buckets) as it is."""
    for block in stage.blocks.values():
        block.compile()


def _timed(side: Side, steps: range, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for step in steps:
        side.step(step)
    _sync(device)
    return time.perf_counter() - start


def _batch_load_ms(cfg: JobConfig, device: torch.device, shares: list[list[list[int]]]) -> float:
    """What the trainer spends per step reading its samples on the CPU and copying them to the device (it
    does this inside its step, while the device waits); the plain loop's batches are on the device already."""
    dataset = open_dataset(cfg)
    times = []
    for step in shares:
        _sync(device)
        start = time.perf_counter()
        for ids in step:
            for t in load_batch(dataset, ids):
                t.to(device)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _param_counts(model: GPTStage) -> dict[str, int]:
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    embedding = sum(p.numel() for name, p in named.items() if name.split(".")[0] in ("wte", "wpe"))
    return {"total": total, "embedding": embedding, "matmul": total - embedding}


def _peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} torch threads)"


def _header(cfg: JobConfig, plan: Plan, device: torch.device, precision: str, counts: dict[str, int],
            flops_per_token: float, peak: float | None, args: argparse.Namespace) -> str:
    m = cfg.model
    amp = "bf16 autocast, fp32 weights, gradients and AdamW state" if precision == "bf16" else "fp32"
    peak_text = f"{peak:g} TFLOP/s (bf16 dense)" if peak else "unknown (MFU not computed; --peak-tflops sets it)"
    return "\n".join([
        f"device: {_device_name(device)}; torch {torch.__version__}; peak {peak_text}",
        f"model: GPT {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, vocab {m.vocab_size}, seq_len "
        f"{m.seq_len}: {counts['total'] / 1e6:.1f}M parameters, N = {counts['matmul'] / 1e6:.1f}M without the "
        f"wte/wpe embedding tables",
        f"step: {cfg.global_batch} sequences ({cfg.global_batch * m.seq_len} tokens) in {plan.microbatches} "
        f"micro-batch(es); {amp}; AdamW foreach both sides; warm-up + cosine lr; clip {cfg.optimizer.grad_clip}"
        f"{'; blocks torch.compile-d on both sides' if args.compile else ''}",
        f"FLOPs/token = 6 N + 12 L d T = 6 x {counts['matmul']:,} + 12 x {m.n_layer} x {m.d_model} x {m.seq_len} "
        f"= {flops_per_token / 1e9:.4g} GFLOP",
        f"{args.warmup} warm-up steps per side, then {args.rounds} rounds of {args.steps} steps per side, alternating",
    ])


def _result(cfg: JobConfig, plan: Plan, device: torch.device, precision: str, args: argparse.Namespace,
            counts: dict[str, int], flops_per_token: float, peak: float | None, times: dict[str, list[float]],
            losses: dict[str, list[float]], load_ms: float, total_steps: int) -> dict:
    tokens_per_block = args.steps * cfg.global_batch * cfg.model.seq_len
    sides = {}
    for name, block_s in times.items():
        rates = [tokens_per_block / t for t in block_s]
        tokens_per_s = statistics.median(rates)
        sides[name] = {"tokens_per_s": tokens_per_s, "step_ms": 1e3 * statistics.median(block_s) / args.steps,
                       "mfu": flops_per_token * tokens_per_s / (peak * 1e12) if peak else None,
                       "tokens_per_s_per_round": rates}
    ours, plain = sides["trainyard"], sides["plain"]
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses["trainyard"], losses["plain"], strict=True)]
    return {
        "device": _device_name(device), "torch": torch.__version__, "precision": precision, "compile": args.compile,
        "model": {"n_layer": cfg.model.n_layer, "n_head": cfg.model.n_head, "d_model": cfg.model.d_model,
                  "vocab_size": cfg.model.vocab_size, "seq_len": cfg.model.seq_len},
        "params": counts, "flops_per_token": flops_per_token, "flops_formula": "6 N + 12 L d T, N = params - wte - wpe",
        "peak_tflops": peak, "global_batch": cfg.global_batch, "microbatches": plan.microbatches,
        "tokens_per_step": cfg.global_batch * cfg.model.seq_len, "warmup_steps": args.warmup, "rounds": args.rounds,
        "steps_per_round": args.steps, "steps_per_side": total_steps, "trainyard": ours, "plain": plain,
        "ratio": ours["tokens_per_s"] / plain["tokens_per_s"], "target_ratio": TARGET_RATIO, "target_mfu": TARGET_MFU,
        "loss_max_rel_diff": max(diffs), "first_loss": losses["plain"][0], "last_loss": losses["plain"][-1],
        "trainyard_batch_load_ms": load_ms,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def _summary(r: dict) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    ours, plain = r["trainyard"], r["plain"]
    ratio_verdict = "met" if r["ratio"] >= TARGET_RATIO else "MISSED"
    lines = ["", "| side | tokens/s (median) | step ms | MFU |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {s['tokens_per_s']:,.0f} | {s['step_ms']:.2f} | {pct(s['mfu'])} |"
              for name, s in (("trainyard", ours), ("plain PyTorch", plain))]
    lines.append(f"ratio trainyard / plain: {r['ratio']:.3f} (target >= {TARGET_RATIO}: {ratio_verdict})")
    if ours["mfu"] is not None:
        mfu_verdict = "met" if ours["mfu"] >= TARGET_MFU else "MISSED"
        lines.append(f"MFU trainyard {pct(ours['mfu'])}, plain {pct(plain['mfu'])} (target >= {pct(TARGET_MFU)} on an "
                     f"H100: {mfu_verdict})")
    lines.append(f"losses: step 0 {r['first_loss']:.4f}, last {r['last_loss']:.4f}; the sides differ by at most "
                 f"{r['loss_max_rel_diff']:.1e} (relative) at any step")
    lines.append(f"trainyard's batch reading and copy inside its step: {r['trainyard_batch_load_ms']:.2f} ms "
                 f"({100 * r['trainyard_batch_load_ms'] / ours['step_ms']:.1f}% of its step)")
    if r["peak_memory_gib"] is not None:
        lines.append(f"peak device memory (both sides' models live): {r['peak_memory_gib']:.1f} GiB")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer d_model 64 GPT, batch 4: checks the code path")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; 4 with --tiny)")
    p.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation micro-batches per step")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per side first (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side per round (default 20)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--compile", action="store_true", help="torch.compile every block, on both sides")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak bf16 TFLOP/s for MFU (default: read off the device's name)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    return p


if __name__ == "__main__":
    main()
