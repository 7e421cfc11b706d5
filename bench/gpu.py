"""`python -m bench.gpu`: trainyard's own trainer on one GPU against a plain PyTorch loop of the same GPT.

Runs with torch alone (no Ray, no service), in one process, on one device:
- trainyard: `parallel`'s trainer at world size 1, exactly as a worker runs it:
  `parallel.runtime.driver.RankDriver` (NCCL on CUDA, gloo on CPU) and its `RankTrainer`'s
  `queue_step(step, micro-batch ids)`. Each step reads its samples from the job's (synthetic) dataset on the
  CPU and copies them to the device, as a worker does; the sample ids come
  ready-made, as a worker gets them from the coordinator. The trainer reads each step's figures (loss,
  gradient norm) to the host once, one step late as a worker does (`read_step` once the next step is queued),
  so the device does not idle between steps while the host waits.
- plain: the same model (`parallel.models.whole.full_model`, same init), the same samples of the same steps
  already on the device, autocast around forward and loss (when bf16), mean `F.cross_entropy`, backward,
  `clip_grad_norm_` at the spec's grad_clip, and `torch.optim.AdamW(foreach=True)` (as the trainer's) with
  the trainer's groups (weight decay on matrices and embeddings only) and learning-rate schedule (warm-up
  then cosine, `parallel.optim.optimizer.lr_at`); gradients set to None each step; no host synchronisation in a step.
- with `--diagnose`, two more plain loops, each with one of the trainer's habits added: `plain+buckets`
  (gradients copied into the trainer's flat buckets) and `plain+sync` (reads the norm and the loss
  every step). Their ratios to `plain` tell what each habit costs.
Every side takes the same steps (the same data and learning rate at each index), so the losses match step
by step (in fp32 to rounding; bf16 drifts): the harness reports the largest difference, a check that the
sides do the same work.

Method: warm-up steps of each side first (not timed), then `--rounds` rounds; a round times a block of
`--steps` steps of each side, the order rotating from round to round, each block between two device
synchronisations, so drift of the machine hits every side. Reported: the median over rounds of each side's
tokens/s, the ratio trainyard / plain (target >= 0.97) and each side's MFU (target >= 45% on an H100):

    MFU = FLOPs per token x tokens/s / peak bf16 FLOP/s,   FLOPs per token = 6 N + 12 L d T

(PaLM appendix B, nanoGPT's `estimate_mfu`), N the parameters that take part in matrix products (all but
the token and position embedding tables, which are lookups), L layers, d d_model, T seq_len; the attention
term counts the whole T x T score matrix, as both sources do, though causal attention computes about half.

    python -m bench.gpu --out gpu.json                # GPU: GPT-2 medium shape (406M parameters), bf16, 16 x 1024
    python -m bench.gpu --model llama-1b --out l.json # TinyLlama 1.1B's shape, bf16, 4 x 2048
    python -m bench.gpu --tiny --device cpu --steps 3 # seconds on a CPU: checks the code path, no numbers
    python -m bench.gpu --offload --out gpu.json      # adds trainyard+offload: optimizer and activation offload

The memory plan: each trainyard side is built and warmed up alone, before any other side exists, and its
`torch.cuda.max_memory_allocated` over that (above what was allocated before it) is set beside the memory plan's
device bytes for the job's one rank (`parallel.plan.memory.estimate.rank_memory(plan, 0).total`); the target is the plan
within 5% of it. (On a CPU there is no such count: `measured_bytes` is null.)

With `--offload`, a side `trainyard+offload` runs the same job with `optimizer.offload` and `activation_offload`
on (a second trainer on the same process group): its tokens/s against trainyard's is the offload's step-time
cost, and `offload` in the result holds both trainers' device optimizer bytes, host bytes and peak saved
activation bytes (the device saving), from their last step's StepStats.

Never run in CI (`tests/integration/test_gpu_bench.py` runs only the tiny CPU mode, without timing claims).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from trainyard.parallel.config import DataConfig, JobConfig, ModelConfig, ParallelConfig, ResourcesConfig
from trainyard.parallel.data.datasets import Dataset, load_batch, open_dataset
from trainyard.parallel.data.sampler import step_microbatches
from trainyard.parallel.models import family_of
from trainyard.parallel.models.whole import GPTStage, full_model
from trainyard.parallel.optim.lr_schedules import lr_at
from trainyard.parallel.plan import Plan, PlanError, make_plan
from trainyard.parallel.plan.memory.estimate import rank_memory
from trainyard.parallel.runtime.distributed import shutdown_distributed
from trainyard.parallel.runtime.dp.data_parallel import GradientReducer
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.local_world import free_ports
from trainyard.parallel.runtime.step.step_figures import Figures

GPT_MEDIUM = {"n_layer": 24, "n_head": 16, "d_model": 1024, "vocab_size": 50304, "seq_len": 1024}
LLAMA_1B = {"family": "llama", "n_layer": 22, "n_head": 32, "n_kv_head": 4, "d_model": 2048, "ffn_hidden": 5632,
            "vocab_size": 32000, "seq_len": 2048}
"""TinyLlama 1.1B's shape (grouped-query attention, 4 key/value heads) at its 2048-token context."""
TINY = {"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 256, "seq_len": 32}
TINY_LLAMA = {"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64, "vocab_size": 256,
              "seq_len": 32}
SMALL = {"n_layer": 4, "n_head": 4, "d_model": 256, "vocab_size": 8192, "seq_len": 128}
"""`--small`: the `make bench` step section's CPU model (bench/step.py says why this one)."""
MODELS = {"gpt2-medium": (GPT_MEDIUM, 16), "llama-1b": (LLAMA_1B, 4), "tiny": (TINY, 4),
          "tiny-llama": (TINY_LLAMA, 4), "small": (SMALL, 8)}
"""`--model`: each shape and its default sequences per step (llama-1b: 4 x 2048 tokens, so that both sides'
weights, gradients and AdamW state (2 x 17.6 GB) and one side's activations fit an 80 GB device)."""
TARGET_MEMORY = 0.05
"""The memory plan's device bytes within 5% of `torch.cuda.max_memory_allocated` (the trainyard side alone)."""
TARGET_RATIO = 0.97
TARGET_MFU = 0.45
# Dense bf16 tensor-core peaks (datasheets, without sparsity), matched in order against the device's name.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200 NVL", 835.0),
                    ("H200", 989.4), ("A100", 312.0))
DIST_TIMEOUT_S = 300.0

Shares = list[list[list[int]]]  # [step][micro-batch] -> sample ids
Batches = list[list[tuple[torch.Tensor, ...]]]  # [step][micro-batch] -> (inputs, targets) on the device


@dataclass
class Side:
    """One way of training: `step(i)` queues training step i on the device; `losses()` reads them back."""

    name: str
    model: GPTStage
    step: Callable[[int], None]
    losses: Callable[[], list[float]]


@dataclass(frozen=True)
class PlainVariant:
    """The plain loop, optionally with one habit of the trainer's added, to tell what a difference costs."""

    name: str
    buckets: bool = False
    """Gradients in flat buckets kept for the whole run (the trainer's `GradientReducer`, with no group: each
    parameter's post-accumulate hook copies backward's gradient into its bucket view and counts down its
    bucket), instead of left where backward allocated them."""
    sync: bool = False
    """Read the gradient norm (before AdamW) and the loss as Python floats every step, two waits for the device (as
    the trainer did before it read its step's figures once, at the step's end)."""


PLAIN = PlainVariant("plain")
DIAGNOSTICS = (PlainVariant("plain+buckets", buckets=True), PlainVariant("plain+sync", sync=True))


@dataclass
class Setup:
    """What every harness here starts from: the options, the device (and how to wait for it), the plan, and
    every step's sample ids."""

    args: argparse.Namespace
    device: torch.device
    precision: str
    plan: Plan
    shares: Shares

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def setup_from_args(argv: list[str] | None = None) -> Setup:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; use --device cpu (with --tiny) to check the code path")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for what stays fp32 (every side: process-wide)
    else:
        torch.set_num_threads(args.threads)
    plan = _plan(args, device, precision)
    return Setup(args, device, precision, plan, _shares(plan))


def main(argv: list[str] | None = None) -> dict:
    setup = setup_from_args(argv)
    args, device, precision, plan, shares = setup.args, setup.device, setup.precision, setup.plan, setup.shares
    cfg = plan.config
    memory: dict[str, dict] = {}
    try:
        with _device_peak(device) as measured:
            first, driver, first_stats = _trainyard_side(plan, device, shares)
            _warm_up(first, args, device)
        memory[first.name] = _memory_check(plan, measured)
        sides, offload_stats = [first], None
        if args.offload:
            offloaded = make_plan(dataclasses.replace(
                cfg, optimizer=dataclasses.replace(cfg.optimizer, offload=True), activation_offload=True))
            with _device_peak(device) as measured:
                side, _, offload_stats = _trainyard_side(offloaded, device, shares, driver, "trainyard+offload")
                _warm_up(side, args, device)
            memory[side.name] = _memory_check(offloaded, measured)
            sides.append(side)
        counts = _param_counts(sides[0].model)
        flops_per_token = family_of(cfg.model).flops_per_token(cfg.model)  # 6 N + 12 L d T
        peak = args.peak_tflops if args.peak_tflops is not None else _peak_tflops(device)
        print(_header(cfg, plan, device, precision, counts, flops_per_token, peak, args), flush=True)
        dataset = open_dataset(cfg)
        batches = device_batches(dataset, device, shares)
        variants = (PLAIN, *DIAGNOSTICS) if args.diagnose else (PLAIN,)
        plain = [_plain_side(cfg, device, precision, batches, v) for v in variants]
        for side in plain:
            _warm_up(side, args, device)
        sides += plain
        times = _measure(sides, args, device, cfg.global_batch * cfg.model.seq_len)
        losses = {s.name: s.losses() for s in sides}
        load_ms = _batch_load_ms(dataset, device, shares[:5])
    finally:
        shutdown_distributed()
    result = _result(cfg, plan, device, precision, args, counts, flops_per_token, peak, times, losses, load_ms)
    result["memory"] = memory
    if offload_stats is not None:
        keys = ("optimizer_bytes", "optimizer_host_bytes", "peak_activation_bytes")
        result["offload"] = {"off": {k: first_stats[-1][k] for k in keys},
                             "on": {k: offload_stats[-1][k] for k in keys}}
    print(_summary(result), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"result written to {args.out}")
    return result


def _plan(args: argparse.Namespace, device: torch.device, precision: str) -> Plan:
    shape, default_batch = MODELS["tiny" if args.tiny else "small" if args.small else args.model]
    shape = {**shape, "seq_len": args.seq_len or shape["seq_len"]}
    batch = args.batch if args.batch is not None else default_batch
    cfg = JobConfig(
        name="bench-gpu", model=ModelConfig(**shape), steps=args.warmup + args.rounds * args.steps,
        data=DataConfig(kind="synthetic"), global_batch=batch, precision=precision,
        activation_checkpointing=args.activation_checkpointing,
        parallel=ParallelConfig(microbatches=args.microbatches),
        resources=ResourcesConfig(gpus_per_worker=1 if device.type == "cuda" else 0),
    )
    try:
        return make_plan(cfg)
    except PlanError as e:
        raise SystemExit(f"trainyard's plan refuses this job: {e}") from e


def _shares(plan: Plan) -> Shares:
    """The sample ids of each step's micro-batches, computed up front: a worker gets them from the coordinator."""
    cfg = plan.config
    num_samples = open_dataset(cfg).num_samples
    return [step_microbatches(plan, 0, step, num_samples) for step in range(cfg.steps)]


def _trainyard_side(plan: Plan, device: torch.device, shares: Shares, driver: RankDriver | None = None,
                    name: str = "trainyard") -> tuple[Side, RankDriver, list[dict]]:
    """The trainer's side, its driver (a second side reuses it: `trainer_for`) and its steps' StepStats."""
    if driver is None:
        driver = RankDriver(plan, 0, "127.0.0.1", free_ports(1)[0], device, DIST_TIMEOUT_S)
        trainer = driver.trainer
    else:
        trainer = driver.trainer_for(plan)
    stats: list[dict] = []
    queued: list[Figures] = []

    def step(i: int) -> None:  # as a worker's step call: step i queued, then step i - 1's figures read
        queued.append(trainer.queue_step(i, shares[i]))
        if len(queued) > 1:
            stats.append(trainer.read_step(queued.pop(0)).to_dict())

    def losses() -> list[float]:  # the last step's figures too
        stats.extend(trainer.read_step(q).to_dict() for q in queued)
        queued.clear()
        return [s["loss"] for s in stats]

    (model,) = trainer.chunks  # world size 1: one stage holding the whole model
    return Side(name, model, step, losses), driver, stats


def _plain_side(cfg: JobConfig, device: torch.device, precision: str, batches: Batches,
                variant: PlainVariant) -> Side:
    """The textbook loop (with `variant`'s habit of the trainer's, if any) on batches already on the device."""
    model = full_model(cfg.model, cfg.seed).to(device)
    model.set_activation_checkpointing(cfg.activation_checkpointing)  # the model's own recompute, as the trainer's
    params = list(model.parameters())
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=opt.lr, betas=(opt.beta1, opt.beta2), foreach=True)
    buckets = GradientReducer([params], None) if variant.buckets else None
    pending: list[torch.Tensor | float] = []

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def step(i: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(i, opt, cfg.steps)
        if buckets is not None:
            buckets.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for mb, (inputs, targets) in enumerate(batches[i]):
            with autocast():
                logits = model.lm_head(model.ln_f(model(inputs)))
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / len(batches[i])
            if buckets is not None and mb == len(batches[i]) - 1:
                buckets.arm(0)  # as the trainer does before a chunk's last backward of the step
            loss.backward()
            total += loss.detach()
        if buckets is not None:
            buckets.finish()
        if opt.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, opt.grad_clip, foreach=True)
            if variant.sync:
                float(norm)
        optimizer.step()
        pending.append(float(total) if variant.sync else total)

    return Side(variant.name, model, step, lambda: [float(t) for t in pending])


def _compile_blocks(stage: GPTStage) -> None:
    """`torch.compile` each transformer block in place (parameter names unchanged): the same on every side,
    and it leaves the trainer's own step (pipeline executor, loss, gradient buckets) as it is."""
    for block in stage.blocks.values():
        block.compile()


def _warm_up(side: Side, args: argparse.Namespace, device: torch.device) -> None:
    """The side's untimed first steps (the allocator's pools, kernel selection), its blocks compiled first with
    `--compile` (the compilation then happens here)."""
    if args.compile:
        _compile_blocks(side.model)
    for step in range(args.warmup):
        side.step(step)
    _sync(device)


@contextlib.contextmanager
def _device_peak(device: torch.device) -> Iterator[dict[str, int | None]]:
    """`{"bytes": ...}` once the block ends: the most device bytes allocated at once during it above those
    allocated before (`torch.cuda.max_memory_allocated`); None on a CPU."""
    measured: dict[str, int | None] = {"bytes": None}
    if device.type != "cuda":
        yield measured
        return
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield measured
    torch.cuda.synchronize(device)
    measured["bytes"] = torch.cuda.max_memory_allocated(device) - before


def _memory_check(plan: Plan, measured: dict[str, int | None]) -> dict:
    """The memory plan's device bytes for this one rank beside what its construction and warm-up steps took."""
    predicted = rank_memory(plan, 0)
    got = measured["bytes"]
    return {"plan_bytes": predicted.total, "measured_bytes": got, "plan": predicted.to_dict(),
            "plan_over_measured": predicted.total / got if got else None, "target_within": TARGET_MEMORY}


def _measure(sides: list[Side], args: argparse.Namespace, device: torch.device,
             tokens_per_step: int) -> dict[str, list[float]]:
    """Each side's block wall times, one per round (every side warmed up already: `_warm_up`); the sides' order
    rotates from round to round."""
    times: dict[str, list[float]] = {s.name: [] for s in sides}
    for r in range(args.rounds):
        steps = range(args.warmup + r * args.steps, args.warmup + (r + 1) * args.steps)
        shift = r % len(sides)
        for side in sides[shift:] + sides[:shift]:
            times[side.name].append(_timed(side, steps, device))
        rates = (f"{name} {args.steps * tokens_per_step / t[-1]:,.0f}" for name, t in times.items())
        print(f"round {r + 1}/{args.rounds} tokens/s: {', '.join(rates)}", flush=True)
    return times


def _timed(side: Side, steps: range, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for step in steps:
        side.step(step)
    _sync(device)
    return time.perf_counter() - start


def device_batches(dataset: Dataset, device: torch.device, shares: Shares) -> Batches:
    """Every step's micro-batches, loaded and already on the device (the plain loop's input)."""
    return [[tuple(t.to(device) for t in load_batch(dataset, ids)) for ids in step] for step in shares]


def _batch_load_ms(dataset: Dataset, device: torch.device, shares: Shares) -> float:
    """What the trainer spends per step reading its samples on the CPU and copying them to the device (inside
    its step, after it waited for the loss: the device idles meanwhile); the plain loops' are on it already."""
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
    recompute = cfg.activation_checkpointing
    peak_text = f"{peak:g} TFLOP/s (bf16 dense)" if peak else "unknown (MFU not computed; --peak-tflops sets it)"
    return "\n".join([
        f"device: {_device_name(device)}; torch {torch.__version__}; peak {peak_text}",
        f"model: {_describe(m)}: {counts['total'] / 1e6:.1f}M parameters, N = {counts['matmul'] / 1e6:.1f}M "
        f"without the embedding tables",
        f"step: {cfg.global_batch} sequences ({cfg.global_batch * m.seq_len} tokens) in {plan.microbatches} "
        f"micro-batch(es); {amp}; AdamW foreach on every side; warm-up + cosine lr; clip {cfg.optimizer.grad_clip}"
        f"{'; blocks torch.compile-d on every side' if args.compile else ''}"
        f"{f'; activation checkpointing {recompute}' if recompute != 'none' else ''}",
        f"FLOPs/token = 6 N + 12 L d T = 6 x {counts['matmul']:,} + 12 x {m.n_layer} x {m.d_model} x {m.seq_len} "
        f"= {flops_per_token / 1e9:.4g} GFLOP",
        f"{args.warmup} warm-up steps per side, then {args.rounds} rounds of {args.steps} steps per side, rotating",
    ])


def _describe(m: ModelConfig) -> str:
    heads = f"{m.n_head} heads" + (f" ({m.n_kv_head} key/value)" if m.n_kv_head not in (None, m.n_head) else "")
    return f"{m.family} {m.n_layer} layers, d_model {m.d_model}, {heads}, vocab {m.vocab_size}, seq_len {m.seq_len}"


def _result(cfg: JobConfig, plan: Plan, device: torch.device, precision: str, args: argparse.Namespace,
            counts: dict[str, int], flops_per_token: float, peak: float | None, times: dict[str, list[float]],
            losses: dict[str, list[float]], load_ms: float) -> dict:
    tokens_per_block = args.steps * cfg.global_batch * cfg.model.seq_len
    sides = {}
    for name, block_s in times.items():
        rates = [tokens_per_block / t for t in block_s]
        tokens_per_s = statistics.median(rates)
        sides[name] = {"tokens_per_s": tokens_per_s, "step_ms": 1e3 * statistics.median(block_s) / args.steps,
                       "mfu": flops_per_token * tokens_per_s / (peak * 1e12) if peak else None,
                       "ratio_to_plain": None, "tokens_per_s_per_round": rates}
    for side in sides.values():
        side["ratio_to_plain"] = side["tokens_per_s"] / sides["plain"]["tokens_per_s"]
    diffs = [abs(a - b) / abs(b) for name in losses for a, b in zip(losses[name], losses["plain"], strict=True)]
    return {
        "device": _device_name(device), "torch": torch.__version__, "precision": precision, "compile": args.compile,
        "activation_checkpointing": cfg.activation_checkpointing,
        "model": {"family": cfg.model.family, "n_layer": cfg.model.n_layer, "n_head": cfg.model.n_head,
                  "n_kv_head": cfg.model.n_kv_head, "d_model": cfg.model.d_model, "ffn_hidden": cfg.model.ffn_hidden,
                  "vocab_size": cfg.model.vocab_size, "seq_len": cfg.model.seq_len},
        "params": counts, "flops_per_token": flops_per_token, "flops_formula": "6 N + 12 L d T, N = params - wte - wpe",
        "peak_tflops": peak, "global_batch": cfg.global_batch, "microbatches": plan.microbatches,
        "tokens_per_step": cfg.global_batch * cfg.model.seq_len, "warmup_steps": args.warmup, "rounds": args.rounds,
        "steps_per_round": args.steps, "sides": sides, "ratio": sides["trainyard"]["ratio_to_plain"],
        "target_ratio": TARGET_RATIO, "target_mfu": TARGET_MFU, "loss_max_rel_diff": max(diffs),
        "first_loss": losses["plain"][0], "last_loss": losses["plain"][-1], "trainyard_batch_load_ms": load_ms,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def _summary(r: dict) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    sides, ours = r["sides"], r["sides"]["trainyard"]
    lines = ["", "| side | tokens/s (median) | step ms | MFU | vs plain |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {s['tokens_per_s']:,.0f} | {s['step_ms']:.2f} | {pct(s['mfu'])} | "
              f"{s['ratio_to_plain']:.3f} |" for name, s in sides.items()]
    verdict = "met" if r["ratio"] >= TARGET_RATIO else "MISSED"
    lines.append(f"ratio trainyard / plain: {r['ratio']:.3f} (target >= {TARGET_RATIO}: {verdict})")
    if ours["mfu"] is not None:
        verdict = "met" if ours["mfu"] >= TARGET_MFU else "MISSED"
        lines.append(f"MFU trainyard {pct(ours['mfu'])}, plain {pct(sides['plain']['mfu'])} "
                     f"(target >= {pct(TARGET_MFU)} on an H100: {verdict})")
    lines.append(f"losses: step 0 {r['first_loss']:.4f}, last {r['last_loss']:.4f}; the sides differ by at most "
                 f"{r['loss_max_rel_diff']:.1e} (relative) at any step")
    lines.append(f"trainyard's batch reading and copy inside its step: {r['trainyard_batch_load_ms']:.2f} ms "
                 f"({100 * r['trainyard_batch_load_ms'] / ours['step_ms']:.1f}% of its step)")
    if "offload" in r:
        off, on = r["offload"]["off"], r["offload"]["on"]
        lines.append(f"offload: device optimizer state {on['optimizer_bytes'] / 2**20:.1f} MiB (off: "
                     f"{off['optimizer_bytes'] / 2**20:.1f}), host {on['optimizer_host_bytes'] / 2**20:.1f} MiB; peak "
                     f"saved activations on the device {on['peak_activation_bytes'] / 2**20:.1f} MiB (off: "
                     f"{off['peak_activation_bytes'] / 2**20:.1f})")
    if r["peak_memory_gib"] is not None:
        lines.append(f"peak device memory (every side's model and optimizer live): {r['peak_memory_gib']:.1f} GiB")
    for name, m in r.get("memory", {}).items():
        if m["measured_bytes"]:
            off = abs(m["plan_over_measured"] - 1)
            verdict = "met" if off <= TARGET_MEMORY else "MISSED"
            lines.append(f"memory plan, {name} alone: {m['plan_bytes'] / 2**30:.2f} GiB vs max_memory_allocated "
                         f"{m['measured_bytes'] / 2**30:.2f} GiB over its construction and warm-up: plan / measured "
                         f"{m['plan_over_measured']:.3f} (target within {TARGET_MEMORY:.0%}: {verdict})")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--model", choices=list(MODELS), default="gpt2-medium",
                   help="gpt2-medium (406M, seq 1024, batch 16; the default), llama-1b (TinyLlama 1.1B's shape, seq "
                        "2048, batch 4), tiny and tiny-llama (2 layers, d_model 64, batch 4: check the code path), "
                        "small (the CPU step section's GPT)")
    p.add_argument("--tiny", action="store_true", help="= --model tiny")
    p.add_argument("--small", action="store_true", help="= --model small")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the model's)")
    p.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation micro-batches per step")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per side first (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side per round (default 20)")
    p.add_argument("--rounds", type=int, default=6, help="rounds, the sides' order rotating (default 6)")
    p.add_argument("--activation-checkpointing", choices=("none", "full", "selective"), default="none",
                   help="recompute activations in backward, on every side (MFU still counts model FLOPs only)")
    p.add_argument("--compile", action="store_true", help="torch.compile every block, on every side")
    p.add_argument("--offload", action="store_true",
                   help="add a side trainyard+offload: optimizer.offload and activation_offload on")
    p.add_argument("--diagnose", action="store_true",
                   help="also time plain+buckets and plain+sync: what the trainer's gradient buckets and per-step "
                        "reads cost")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak bf16 TFLOP/s for MFU (default: read off the device's name)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    return p


if __name__ == "__main__":
    main()
