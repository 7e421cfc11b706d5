"""`python -m bench.gpu_big`: a Llama larger than one 80 GiB device, trained on one device with `optimizer.offload`.

The job: Llama-2-7B's blocks (d_model 4096, 32 heads, 32 key/value heads, ffn 11008, vocab 32000, seq 2048),
DEFAULT_LAYERS of its 32 by default (`--n-layer 32` for all of them: see DEFAULT_LAYERS), bf16 autocast over fp32
weights, gradients and AdamW state, full recompute, synthetic data, `--batch` sequences a step, one rank.

1. The memory plan's verdict on one GPU of `--device-gib` (default 80): the job without offload (refused: its
   parameters, gradients and AdamW state alone exceed it) and with `optimizer.offload` (fits), each with the plan's
   device bytes (`RankMemory.total`) and host bytes (`RankMemory.host`). A no-offload job that fits is a plan defect
   and is printed as one.
2. The host check, before anything is built: the offload job's host bytes (the plan's, which on a GPU rank count
   what torch's pinned allocator adds by rounding each host copy up to a power of two: `host_estimate`) with
   RESERVE_GIB to spare against the memory available (/proc/meminfo's MemAvailable, or the memory cgroup's headroom
   where smaller); refused with a message when they do not fit. While it runs, a watchdog ends the process if the
   available memory falls below FLOOR_GIB.
3. `parallel.runtime.driver.RankDriver` at world size 1 builds the job (meta construction, each parameter drawn
   whole on the host, the pinned host copies) and runs `--warmup` + `--steps` steps (each step's figures read at
   once), the timed steps cut short when the next would overrun `--time-budget-s` from the start.

Figures (measured / plan ratios beside them):
- step time: (the timed steps' times + `tail_s`) / their count, a step's time being its call to its figures read;
  the host AdamW update of step i runs behind step i+1's forward (the warm-up's is waited for before the timed
  steps), so each timed step but the first holds its predecessor's update and `tail_s` waits for the last one's;
- device peak: `torch.cuda.max_memory_allocated` over construction and steps, beside the plan's device bytes;
- host peak: VmHWM minus the RSS before construction (the peak reset there), beside the plan's host bytes and the
  estimate; system peak: the largest drop of the available memory below its value before construction (sampled
  every 0.1 s), which counts pinned memory however the kernel accounts for it.
`--plan-only` stops after 2.

    python -m bench.gpu_big --out big.json                     # the GPU run (~3 minutes)
    python -m bench.gpu_big --plan-only --n-layer 32           # the plan's figures only, no torch device needed
    python -m bench.gpu_big --tiny --device cpu --out t.json   # seconds on a CPU: the same code path, tiny shape
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path

import torch
from trainyard.parallel.config import DataConfig, JobConfig, ModelConfig, OptimizerConfig, ResourcesConfig
from trainyard.parallel.models import family_of
from trainyard.parallel.models.counting import FP32
from trainyard.parallel.plan import Plan, PlanError, make_plan
from trainyard.parallel.plan.admission import ClusterResources, NodeResources
from trainyard.parallel.plan.memory.estimate import host_copy_bytes, optimizer_elements, rank_memory, trainable_counts
from trainyard.parallel.runtime import trainer as trainer_module
from trainyard.parallel.runtime.distributed import shutdown_distributed
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.host_memory import resident_bytes
from trainyard.parallel.runtime.local_world import free_ports

from bench.gpu import DIST_TIMEOUT_S, _device_name, _peak_tflops

GIB = 2**30
LLAMA2_7B = {"family": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 32, "d_model": 4096, "ffn_hidden": 11008,
             "vocab_size": 32000, "seq_len": 2048}
"""Llama-2-7B's shape (6.74B parameters)."""
DEFAULT_LAYERS = 28
"""28 of Llama-2-7B's 32 blocks (5.93B parameters): offloaded, each parameter has a pinned host copy and a pinned
host gradient, which torch's pinned allocator rounds up to a power of two (a 4096 x 11008 fp32 matrix, 172 MiB,
takes 256 MiB), so the host holds 116 GiB at 32 blocks (100.4 without the rounding, which the plan counts) and
102 GiB at 28, plus the process's own: 28 leaves the 15% of a 128 GiB machine that 32 does not. Without offload
the plan still refuses it on 80 GiB (92.0 GiB at 2 x 2048 tokens)."""
TINY = {"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 4, "d_model": 128, "ffn_hidden": 352,
        "vocab_size": 1024, "seq_len": 64}
TINY_DEVICE_GIB = 10 / 1024
"""`--tiny`'s device (10 MiB): between the tiny job's device bytes without offload and with it, as 80 GiB is for
the large one."""
RESERVE_GIB = 4.0
"""Host memory the check leaves free beyond the estimate (allocator slack, CUDA and NCCL buffers, the page cache)."""
FLOOR_GIB = 3.0
"""The watchdog ends the process when the available memory falls below this (rather than let the machine swap or
OOM)."""
SAMPLE_S = 0.1
ZERO3_PARAM_OFFLOAD = ("absent: parallel.runtime.dp.fsdp (ZeRO-2/3, FSDP2) has no parameter offload (no "
                       "CPUOffloadPolicy), and at world size 1 it leaves every parameter out of FSDP (a set reduced by "
                       "this rank alone), so only optimizer.offload runs")


def main(argv: list[str] | None = None) -> dict:
    started = time.perf_counter()
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available() and not args.plan_only:
        raise SystemExit("no CUDA device here; use --device cpu (with --tiny) to check the code path")
    shape = {**(TINY if args.tiny else LLAMA2_7B), **({"seq_len": args.seq_len} if args.seq_len else {})}
    shape["n_layer"] = args.n_layer or (TINY["n_layer"] if args.tiny else DEFAULT_LAYERS)
    device_gib = args.device_gib if args.device_gib is not None else TINY_DEVICE_GIB if args.tiny else 80.0
    batch = args.batch if args.batch is not None else 2
    model = ModelConfig(**shape)
    result: dict = {"device": None, "torch": torch.__version__, "model": shape, "precision": args.precision,
                    "activation_checkpointing": "full", "global_batch": batch, "tokens_per_step": batch * model.seq_len,
                    "zero3_param_offload": ZERO3_PARAM_OFFLOAD}
    verdicts = {name: _verdict(_job(model, args, batch, offload, gpus=1), device_gib)
                for name, offload in (("no_offload", False), ("offload", True))}
    result["plan"] = {"device_gib": device_gib, **verdicts}
    if cuda and torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
        torch.zeros(1, device=device)  # the CUDA context exists before the host check
        result["device"] = _device_name(device)
        own_gib = torch.cuda.get_device_properties(device).total_memory / GIB
        result["plan"]["this_device"] = {"gib": own_gib, **{name: _verdict(_job(model, args, batch, offload, gpus=1),
                                                                               own_gib)["verdict"]
                                                            for name, offload in (("no_offload", False),
                                                                                  ("offload", True))}}
    else:
        torch.set_num_threads(args.threads)
        result["device"] = _device_name(device) if not cuda else f"{device} (not here: the plan's figures only)"
    plan = make_plan(_job(model, args, batch, offload=True, gpus=1 if cuda else 0))
    result["params"] = _param_count(model)
    check = _host_check(plan, cuda)
    result["host_check"] = check
    print(_plan_text(result, device_gib), flush=True)
    if args.plan_only:
        return _finish(result, args)
    if not check["fits"]:
        raise SystemExit(f"refused: the offload job needs about {check['estimate'] / GIB:.1f} GiB of host memory "
                         f"(the plan's {check['plan_host'] / GIB:.1f} GiB plus {check['pinned_rounding'] / GIB:.1f} "
                         f"GiB of pinned rounding) and {RESERVE_GIB:g} GiB to spare, but only "
                         f"{check['available'] / GIB:.1f} GiB are available (MemAvailable, or the memory cgroup's); "
                         f"--n-layer {check['layers_that_fit']} would fit"
                         if check["layers_that_fit"] else "refused: not even one layer fits this host's memory")
    result.update(_run(plan, device, args, started))
    return _finish(result, args)


def _job(model: ModelConfig, args: argparse.Namespace, batch: int, offload: bool, gpus: int) -> JobConfig:
    return JobConfig(
        name="bench-gpu-big", model=model, steps=args.warmup + args.steps, data=DataConfig(kind="synthetic"),
        global_batch=batch, precision=args.precision, activation_checkpointing="full",
        optimizer=OptimizerConfig(offload=offload), resources=ResourcesConfig(gpus_per_worker=gpus))


def _verdict(cfg: JobConfig, device_gib: float) -> dict:
    """The plan's answer for `cfg` on one node with one GPU of `device_gib` (its admission check), with its figures."""
    memory = rank_memory(make_plan(cfg), 0)
    cluster = ClusterResources((NodeResources(cpus=16, gpus=1, memory=128 * GIB, gpu_memory=device_gib * GIB),))
    try:
        make_plan(cfg, cluster)
        verdict, message = "fits", None
    except PlanError as e:
        verdict, message = "refused", str(e)
    return {"verdict": verdict, "message": message, "device_bytes": memory.total, "host_bytes": memory.host,
            "memory": memory.to_dict()}


def _param_count(model: ModelConfig) -> int:
    """The model's parameters, as its family counts them (the memory plan's count)."""
    return family_of(model).param_counts(model, range(model.n_layer), first=True, last=True, tp=1, ep=1).total


def host_estimate(plan: Plan, cuda: bool) -> tuple[int, int]:
    """(the plan's host bytes but the pinned allocator's rounding, that rounding): offloaded, every parameter has a host
    copy and a host gradient (fp32), pinned on CUDA, where `CachingHostAllocator` rounds each allocation up to a power
    of two, which the plan counts on a GPU rank (`parallel.plan.memory.estimate.host_copy_bytes`); the optimizer's state
    (`zeros_like`, not pinned) is exact. Their sum is the plan's host bytes."""
    memory = rank_memory(plan, 0)
    if not cuda or not plan.config.optimizer.offload:
        return memory.host, 0
    counts = trainable_counts(plan, 0)
    rounding = host_copy_bytes(plan, 0, counts) - 2 * FP32 * optimizer_elements(plan, counts)
    return memory.host - rounding, rounding


def _host_check(plan: Plan, cuda: bool) -> dict:
    """The offload job's host bytes against the available memory (RESERVE_GIB to spare), and the most layers that
    fit."""
    info = meminfo()

    def need(layers: int) -> tuple[int, int, int]:
        p = plan if layers == plan.config.model.n_layer else make_plan(dataclasses.replace(
            plan.config, model=dataclasses.replace(plan.config.model, n_layer=layers)))
        host, rounding = host_estimate(p, cuda)
        return host, rounding, max(host + rounding, rank_memory(p, 0).construction)

    host, rounding, estimate = need(plan.config.model.n_layer)
    room = info["available"] - RESERVE_GIB * GIB
    fits = estimate <= room
    layers = plan.config.model.n_layer
    while not fits and layers > 1 and need(layers)[2] > room:
        layers -= 1
    return {"plan_host": host, "pinned_rounding": rounding, "estimate": estimate, "reserve": int(RESERVE_GIB * GIB),
            "mem_total": info["MemTotal"], "mem_available": info["MemAvailable"],
            "available": info["available"], "fits": fits,
            "margin_of_total": 1 - estimate / info["MemTotal"],
            "layers_that_fit": None if fits else layers if need(layers)[2] <= room else 0}


def meminfo() -> dict[str, int]:
    """/proc/meminfo's MemTotal and MemAvailable, in bytes, and `available`: MemAvailable, or less where this
    process's memory cgroup (v2 or v1) leaves less (its limit minus its use, inactive file pages not counted as use):
    a container's /proc/meminfo shows the whole machine's."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(value.split()[0]) * 1024
    group = _cgroup_headroom()
    out["available"] = out["MemAvailable"] if group is None else min(out["MemAvailable"], group)
    return out


def _cgroup_headroom() -> int | None:
    for limit, usage, stat, inactive in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                          "memory/memory.stat", "total_inactive_file")):
        root = Path("/sys/fs/cgroup")
        try:
            text = (root / limit).read_text().strip()
            if text == "max" or int(text) >= 2**60:  # no limit (v1 writes a huge number)
                return None
            lines = dict(line.split() for line in (root / stat).read_text().splitlines() if len(line.split()) == 2)
            return int(text) - int((root / usage).read_text()) + int(lines.get(inactive, 0))
        except (OSError, ValueError):
            continue
    return None


def proc_status() -> dict[str, int]:
    """This process's VmRSS and VmHWM, in bytes."""
    return {field: resident_bytes(field) or 0 for field in ("VmRSS", "VmHWM")}


def _reset_peak_rss() -> bool:
    """VmHWM set back to VmRSS (`clear_refs` 5, Linux 4.0+); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryWatch:
    """Samples the available memory (`meminfo`) every SAMPLE_S on a thread: the lowest seen, and the process ended
    (exit 3, with a message) when it falls below FLOOR_GIB."""

    def __init__(self) -> None:
        self.lowest = meminfo()["available"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            available = meminfo()["available"]
            self.lowest = min(self.lowest, available)
            if available < FLOOR_GIB * GIB:
                print(f"\nABORTED by the memory watchdog: available memory {available / GIB:.2f} GiB < "
                      f"{FLOOR_GIB:g} GiB "
                      f"(this process's RSS {proc_status()['VmRSS'] / GIB:.1f} GiB); ending it before the machine "
                      f"swaps or the OOM killer picks", flush=True)
                os._exit(3)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.lowest


class _Timings:
    """Seconds spent in construction's two large parts, read off the trainer's calls (no behaviour changed)."""

    def __init__(self) -> None:
        self.materialize_s = 0.0
        self.optimizer_s = 0.0

    def patch(self) -> None:
        materialize, optimizer = trainer_module.materialize, trainer_module.TrainOptimizer
        timings = self

        def timed_materialize(*a, **kw):
            start = time.perf_counter()
            try:
                return materialize(*a, **kw)
            finally:
                timings.materialize_s += time.perf_counter() - start

        class TimedOptimizer(optimizer):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **kw):
                start = time.perf_counter()
                super().__init__(*a, **kw)
                timings.optimizer_s += time.perf_counter() - start

        trainer_module.materialize, trainer_module.TrainOptimizer = timed_materialize, TimedOptimizer
        self._restore = (materialize, optimizer)

    def restore(self) -> None:
        trainer_module.materialize, trainer_module.TrainOptimizer = self._restore


def _run(plan: Plan, device: torch.device, args: argparse.Namespace, started: float) -> dict:
    cuda = device.type == "cuda"
    cfg = plan.config
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device)
    reset = _reset_peak_rss()
    rss_before = proc_status()["VmRSS"]
    available_before = meminfo()["available"]
    watch = MemoryWatch()
    timings = _Timings()
    timings.patch()
    start = time.perf_counter()
    try:
        driver = RankDriver(plan, 0, "127.0.0.1", free_ports(1)[0], device, DIST_TIMEOUT_S)
        if cuda:
            torch.cuda.synchronize(device)
    finally:
        timings.restore()
    construction_s = time.perf_counter() - start
    after_construction = {"host_rss": proc_status()["VmRSS"] - rss_before,
                          "device_allocated": torch.cuda.memory_allocated(device) - allocated_before if cuda else None}
    print(f"constructed in {construction_s:.1f} s (materialize {timings.materialize_s:.1f} s, optimizer's host copies "
          f"{timings.optimizer_s:.1f} s)", flush=True)
    steps: list[dict] = []
    cut = False
    try:
        last = time.perf_counter()
        for i in range(cfg.steps):
            timed = i >= args.warmup
            if timed and steps and i > args.warmup:
                longest = max(s["time_s"] for s in steps if s["timed"])
                if time.perf_counter() - started + longest > args.time_budget_s:
                    cut = True
                    break
            stats = driver.step(i)
            if i == args.warmup - 1:  # the warm-up's host update (AdamW's state made) lands before the timed steps
                _settle(driver, device)
            now = time.perf_counter()
            steps.append({"step": i, "timed": timed, "time_s": now - last,
                          **{k: stats[k] for k in ("loss", "grad_norm", "lr", "optimizer_bytes", "optimizer_host_bytes",
                                                   "peak_activation_bytes")}})
            print(f"step {i} ({'timed' if timed else 'warm-up'}): {now - last:.2f} s, loss {stats['loss']:.4f}",
                  flush=True)
            last = now
        _settle(driver, device)  # the last step's host update, which no forward follows
        tail_s = time.perf_counter() - last
    finally:
        lowest = watch.stop()
        shutdown_distributed()
    status = proc_status()
    timed = [s["time_s"] for s in steps if s["timed"]]
    step_s = (sum(timed) + tail_s) / len(timed) if timed else None
    memory = rank_memory(plan, 0)
    host_plan, rounding = host_estimate(plan, cuda)
    host_peak = status["VmHWM"] - rss_before if reset else None
    system_peak = available_before - lowest
    device_peak = torch.cuda.max_memory_allocated(device) - allocated_before if cuda else None
    flops_per_token = family_of(cfg.model).flops_per_token(cfg.model)
    tokens_per_s = cfg.global_batch * cfg.model.seq_len / step_s if step_s else None
    peak = _peak_tflops(device)
    return {
        "construction": {"total_s": construction_s, "materialize_s": timings.materialize_s,
                         "optimizer_s": timings.optimizer_s, **after_construction},
        "steps": steps, "timed_steps": len(timed), "cut_by_time_budget": cut, "time_budget_s": args.time_budget_s,
        "step_time_s": step_s, "step_time_median_s": statistics.median(timed) if timed else None, "tail_s": tail_s,
        "tokens_per_s": tokens_per_s,
        "mfu": flops_per_token * tokens_per_s / (peak * 1e12) if peak and tokens_per_s else None,
        "losses_finite": all(math.isfinite(s["loss"]) for s in steps),
        "device_memory": {"peak_allocated": device_peak, "plan_total": memory.total,
                          "peak_over_plan": device_peak / memory.total if device_peak else None,
                          "peak_reserved": torch.cuda.max_memory_reserved(device) if cuda else None},
        "host_memory": {"rss_before": rss_before, "hwm": status["VmHWM"], "peak_above_before": host_peak,
                        "peak_reset": reset, "plan_host": host_plan, "estimate": host_plan + rounding,
                        "peak_over_plan": host_peak / host_plan if host_peak and host_plan else None,
                        "peak_over_estimate": host_peak / (host_plan + rounding) if host_peak and host_plan else None,
                        "system_peak_above_before": system_peak, "lowest_available": lowest,
                        "system_peak_over_estimate": system_peak / (host_plan + rounding) if host_plan else None},
        "wall_s": time.perf_counter() - started,
    }


def _settle(driver: RankDriver, device: torch.device) -> None:
    """Every host update queued so far landed, on the host and on the device."""
    driver.trainer.optimizer.settle()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plan_text(r: dict, device_gib: float) -> str:
    p, check = r["plan"], r["host_check"]
    m = r["model"]
    lines = [f"device: {r['device']}; torch {r['torch']}",
             f"model: llama {m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads ({m['n_kv_head']} "
             f"key/value), ffn {m['ffn_hidden']}, vocab {m['vocab_size']}: {r['params'] / 1e9:.2f}B parameters; "
             f"{r['global_batch']} x {m['seq_len']} tokens a step, {r['precision']}, full recompute",
             f"memory plan on one GPU of {_gib(device_gib * GIB)}:"]
    for name, label in (("no_offload", "without offload"), ("offload", "optimizer.offload")):
        v = p[name]
        lines.append(f"  {label}: {v['verdict'].upper()}: device {_gib(v['device_bytes'])}, host "
                     f"{_gib(v['host_bytes'])}" + (f" ({v['message']})" if v["message"] else ""))
    if p["no_offload"]["verdict"] == "fits":
        lines.append(f"  !!! PLAN DEFECT: the plan admits the job without offload on {_gib(device_gib * GIB)}: it "
                     f"should refuse parameters, gradients and AdamW state of {r['params'] / 1e9:.2f}B parameters !!!")
    if "this_device" in p:
        d = p["this_device"]
        lines.append(f"  on this device ({_gib(d['gib'] * GIB)}): without offload {d['no_offload']}, with offload "
                     f"{d['offload']}")
    lines.append(f"host check: plan {_gib(check['plan_host'])} + pinned rounding {_gib(check['pinned_rounding'])} = "
                 f"{_gib(check['estimate'])} (+{RESERVE_GIB:g} GiB reserve) vs available "
                 f"{_gib(check['available'])} (MemAvailable "
                 f"{_gib(check['mem_available'])}) of {_gib(check['mem_total'])}: "
                 f"{'fits' if check['fits'] else 'DOES NOT FIT'} ({check['margin_of_total']:.0%} of MemTotal spare)")
    lines.append(f"ZeRO-3 with offloaded parameters: {r['zero3_param_offload']}")
    return "\n".join(lines)


def _summary(r: dict) -> str:
    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    d, h, c = r["device_memory"], r["host_memory"], r["construction"]
    step = r["step_time_s"]
    lines = ["", "| figure | measured | plan | measured / plan |", "|---|---:|---:|---:|",
             f"| device peak (max_memory_allocated) | {_gib(d['peak_allocated'])} | {_gib(d['plan_total'])} | "
             f"{ratio(d['peak_over_plan'])} |",
             f"| host peak (VmHWM above RSS before) | {_gib(h['peak_above_before'])} | {_gib(h['plan_host'])} | "
             f"{ratio(h['peak_over_plan'])} |",
             f"| host peak vs plan + pinned rounding | {_gib(h['peak_above_before'])} | {_gib(h['estimate'])} | "
             f"{ratio(h['peak_over_estimate'])} |",
             f"| system peak (drop of available memory) | {_gib(h['system_peak_above_before'])} | "
             f"{_gib(h['estimate'])} | "
             f"{ratio(h['system_peak_over_estimate'])} |",
             f"| step time ({r['timed_steps']} steps and the last update) | "
             f"{'-' if step is None else f'{step:.2f} s'} | - | - |",
             f"| construction (materialize, host copies) | {c['total_s']:.1f} s ({c['materialize_s']:.1f}, "
             f"{c['optimizer_s']:.1f}) | - | - |"]
    if r["tokens_per_s"]:
        mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] else ""
        lines.append(f"{r['tokens_per_s']:,.0f} tokens/s{mfu}; the last host update waited for {r['tail_s']:.2f} "
                     f"s; wall {r['wall_s']:.1f} s" + ("; steps CUT by --time-budget-s" if r["cut_by_time_budget"]
                                                       else ""))
    losses = [round(s["loss"], 4) for s in r["steps"]]
    lines.append(f"losses {losses}: {'finite' if r['losses_finite'] else 'NOT FINITE'}")
    return "\n".join(lines)


def _finish(result: dict, args: argparse.Namespace) -> dict:
    if "steps" in result:
        print(_summary(result), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"result written to {args.out}")
    return result


def _gib(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.2f} MiB"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_big", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer llama (seconds on a CPU): checks the code path")
    p.add_argument("--n-layer", type=int, default=None,
                   help=f"blocks of Llama-2-7B's shape (default {DEFAULT_LAYERS}; 32 is Llama-2-7B)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; tiny 64)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 2)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="bf16 autocast (default) or fp32")
    p.add_argument("--device-gib", type=float, default=None,
                   help=f"the GPU memory the plan's verdicts are asked against (default 80; tiny {TINY_DEVICE_GIB})")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    p.add_argument("--time-budget-s", type=float, default=170.0,
                   help="no timed step is started that would end past this many seconds from the start (default 170)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    p.add_argument("--plan-only", action="store_true", help="the plan's verdicts and the host check only")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    return p


if __name__ == "__main__":
    main()
