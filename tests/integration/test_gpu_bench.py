"""bench/gpu.py's tiny CPU mode: the GPU benchmark's code path runs and reports its numbers (no timing claims);
the GPU harnesses import neither Ray nor the service; and (slow) bench/gpu_big.py's tiny run and
bench/gpu_smoke.py's variants added for LoRA,
whole and packed examples, grouped experts, adamw8bit and the construction check run on the CPU with their JSON
summary, and its host-read check (CUDA's sync debug mode) counts each driver call against its budget and names an
extra synchronization, with CUDA's synchronizing operations stood in for on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import slow

from bench import gpu_record
from bench.report import render
from bench.results import Row

REPO = Path(__file__).resolve().parents[2]
NEW_VARIANTS = ["llama moe grouped bf16", "llama tied, moe with capacity", "llama lora fp32", "llama lora bf16",
                "llama packed fp32", "llama packed bf16", "gpt2 packed, full recompute", "llama examples unpacked",
                "gpt2 adamw8bit", "gpt2 adamw8bit offload"]


def _recorded(tmp_path: Path, files: dict[str, dict]) -> list[Row]:
    """`files` written as a GPU session's $OUT, then recorded into a results file whose section `gpu` BENCHMARKS.md's
    marker shows: the rows, after checking that the report renders them with no problem."""
    folder = tmp_path / "session"
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content))
    (folder / "summary.txt").write_text("2026-11-28T09:00:00Z\nNVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04\n"
                                        "torch 2.11.0+cu130\nsmoke rc=0 42s\n")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"machine": {}, "sections": {}, "rows": []}))
    assert gpu_record.main([str(folder), "--commit", "0123456789abcdef", "--results", str(results)]) == 0
    doc, problems = render("<!-- table: gpu -->\n<!-- /table -->\n", json.loads(results.read_text()))
    assert not problems and "NVIDIA H100 80GB HBM3" in doc and "commit 0123456789ab" in doc
    return gpu_record.rows(folder)


def test_gpu_bench_tiny_cpu_mode_reports_every_side_and_matching_losses(tmp_path):
    precision = "bf16"  # the GPU's setting (fp32 takes the same path without autocast)
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "bench.gpu", "--model", "tiny-llama", "--device", "cpu", "--precision", precision,
           "--warmup", "1", "--steps", "2", "--rounds", "2", "--diagnose", "--offload", "--peak-tflops", "1",
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ratio trainyard / plain" in done.stdout
    result = json.loads(out.read_text())
    assert set(result["sides"]) == {"trainyard", "trainyard+offload", "plain", "plain+buckets", "plain+sync"}
    off, on = result["offload"]["off"], result["offload"]["on"]  # offload moves state and activations off the device
    assert on["optimizer_bytes"] == 0 < off["optimizer_bytes"] < on["optimizer_host_bytes"]
    assert on["peak_activation_bytes"] < off["peak_activation_bytes"]
    for side in result["sides"].values():
        assert side["tokens_per_s"] > 0 and side["mfu"] > 0 and side["ratio_to_plain"] > 0
        assert len(side["tokens_per_s_per_round"]) == 2
    assert result["ratio"] == result["sides"]["trainyard"]["ratio_to_plain"]
    assert result["params"]["matmul"] > 0 and result["flops_per_token"] > 6 * result["params"]["matmul"]
    # Same init, samples, optimizer, schedule and autocast: every side computes the same losses (to rounding).
    assert result["precision"] == precision
    assert result["loss_max_rel_diff"] < 1e-4
    # each trainyard side's memory plan, beside a device count that a CPU does not have
    for name in ("trainyard", "trainyard+offload"):
        memory = result["memory"][name]
        assert memory["plan_bytes"] == memory["plan"]["total"] > 0 and memory["measured_bytes"] is None
    assert result["memory"]["trainyard+offload"]["plan"]["optimizer"] == 0
    # as a GPU session records it (bench.gpu_record), with a device's count of the memory set in
    result["memory"]["trainyard"]["measured_bytes"] = int(result["memory"]["trainyard"]["plan_bytes"] / 1.04)
    rows = _recorded(tmp_path, {"step-llama.json": result})
    assert [r.name.split(", ", 1)[1] for r in rows] == [
        "trainyard vs a plain loop, tokens/s", "MFU gap to the plain loop", "memory plan vs max_memory_allocated"]
    assert rows[2].ratio == pytest.approx(1.04, abs=1e-3) and rows[2].met()  # within 5%


@slow
def test_gpu_big_tiny_cpu_mode_is_refused_without_offload_and_trains_with_it(tmp_path):
    out = tmp_path / "big.json"
    cmd = [sys.executable, "-m", "bench.gpu_big", "--tiny", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| device peak (max_memory_allocated) |" in done.stdout and "PLAN DEFECT" not in done.stdout
    r = json.loads(out.read_text())
    plan = r["plan"]  # against the tiny device: refused without offload, fits with it
    assert plan["no_offload"]["verdict"] == "refused" and "needs" in plan["no_offload"]["message"]
    assert plan["offload"]["verdict"] == "fits" and plan["offload"]["message"] is None
    assert plan["offload"]["device_bytes"] < plan["device_gib"] * 2**30 < plan["no_offload"]["device_bytes"]
    assert plan["offload"]["host_bytes"] > 0 == plan["no_offload"]["host_bytes"]
    assert r["host_check"]["fits"] and r["host_check"]["pinned_rounding"] == 0  # nothing pinned without CUDA
    assert [s["timed"] for s in r["steps"]] == [False, True, True, True] and r["timed_steps"] == 3
    assert r["losses_finite"] and all(s["time_s"] > 0 for s in r["steps"]) and r["step_time_s"] > 0
    assert all(s["optimizer_bytes"] == 0 < s["optimizer_host_bytes"] for s in r["steps"])  # offloaded
    assert r["construction"]["total_s"] > r["construction"]["materialize_s"] > 0
    assert r["construction"]["optimizer_s"] > 0
    host = r["host_memory"]
    assert host["peak_above_before"] > 0 and host["plan_host"] == host["estimate"] < plan["offload"]["host_bytes"]
    assert host["peak_over_plan"] > 0  # (the verdicts plan a GPU rank, whose pinned host copies are rounded up)
    assert r["device_memory"]["peak_allocated"] is None and r["device_memory"]["plan_total"] > 0  # a CPU
    assert r["zero3_param_offload"].startswith("absent")
    rows = _recorded(tmp_path, {"big.json": r})
    assert [row.name for row in rows] == ["gpu: large llama, optimizer offload: step time",
                                          "gpu: large llama: host peak vs the plan"]  # no device count on a CPU
    assert "the plan refuses it" in rows[0].note and rows[0].ours == r["step_time_s"]


def test_gpu_big_plan_refuses_the_large_llama_on_80_gib_and_counts_pinned_rounding(tmp_path):
    # the GPU run's plan, asked here (no device needed): refused without offload, fits with it; the host copies'
    # power-of-two rounding: 3 MLP matrices of 4096 x 11008 fp32 (172 MiB -> 256 MiB) a block, copy and gradient,
    # and the embedding and the head (500 MiB -> 512 MiB)
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "bench.gpu_big", "--plan-only", "--device", "cuda", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    r = json.loads(out.read_text())
    assert r["model"]["n_layer"] == 28 and round(r["params"] / 1e9, 2) == 5.93
    assert r["plan"]["device_gib"] == 80 and r["plan"]["no_offload"]["verdict"] == "refused"
    assert r["plan"]["offload"]["verdict"] == "fits"
    mlp = 4096 * 11008 * 4
    assert r["host_check"]["pinned_rounding"] == 2 * (28 * 3 * (2**28 - mlp) + 2 * (2**29 - 32000 * 4096 * 4))
    assert "steps" not in r


def test_gpu_benches_import_neither_ray_nor_the_service():
    # It runs on GPU machines that hold torch and little else (numpy, and annotated_types for parallel.config).
    # top-level modules, and trainyard's subpackages by name (trainyard.parallel)
    # bench.gpu_smoke imports the export, which once imported pydantic at the top and failed on the device
    code = ("import sys, bench.gpu, bench.gpu_smoke, bench.gpu_profile, bench.gpu_offload_split, bench.gpu_big; "
            "print(' '.join(sorted({'.'.join(m.split('.')[:2 if m.startswith('trainyard.') "
            "else 1]) for m in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=True)
    loaded = set(done.stdout.split())
    assert "trainyard.parallel" in loaded
    assert not loaded & {"ray", "pydantic", "fastapi", "uvicorn", "yaml", "httpx", "trainyard.api", "trainyard.service",
                         "trainyard.actors"}


@slow
def test_gpu_smoke_new_variants_pass_on_the_cpu_and_write_their_summary(tmp_path):
    out = tmp_path / "smoke.json"
    reads = "host reads: llama moe (ep 1) fp32"  # CUDA only: skipped here, not failed
    cmd = [sys.executable, "-m", "bench.gpu_smoke", "--device", "cpu", "--only", *NEW_VARIANTS, reads,
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok ", "FAIL", "skip"))]
    expected = [f"ok    {name}: " for name in NEW_VARIANTS] + [f"skip  {reads}: "]
    assert len(lines) == len(expected) and all(map(str.startswith, lines, expected)), done.stdout
    n = len(NEW_VARIANTS)
    assert done.stdout.splitlines()[-1] == f"{n} of {n} variants passed on cpu; 1 skipped"
    said = {name: line for name, line in zip([*NEW_VARIANTS, reads], lines, strict=True)}
    assert all("resume equal; exported; construction equal" in said[name] for name in NEW_VARIANTS)
    lora = "base frozen, adapters trained; checkpoint holds 28 adapters alone; merged and PEFT exports"
    assert lora in said["llama lora fp32"] and lora in said["llama lora bf16"]
    assert "states 8-bit" in said["gpt2 adamw8bit"] and "state round trip" in said["gpt2 adamw8bit"]
    summary = json.loads(out.read_text())
    assert summary["device"] == "cpu" and summary["torch"] == torch.__version__
    for name in NEW_VARIANTS:
        entry = summary[name]
        assert entry["ok"] is True and entry["error"] is None and entry["vs"] is None, entry
        assert len(entry["losses"]) == 4 and all(math.isfinite(x) for x in entry["losses"])
    assert summary[reads]["ok"] is None and "CUDA only" in summary[reads]["skipped"]
    # bf16 follows its fp32 twin here too (on CUDA the smoke holds them within 5e-2)
    for bf16, fp32 in (("llama lora bf16", "llama lora fp32"), ("llama packed bf16", "llama packed fp32")):
        assert max(abs(a - b) / b for a, b in zip(summary[bf16]["losses"], summary[fp32]["losses"], strict=True)) \
            < 5e-3


@pytest.fixture
def cuda_syncs_on_the_cpu(monkeypatch):
    """CUDA's sync debug mode stood in for on the CPU: while it is set to "warn", the warning it gives at each
    operation that would synchronize on a GPU: the `tolist()` of a device tensor (one the models and the runtime
    read, but the step's figures, which `Figures.read` reads from pinned host memory after an event; the data's
    tensors are the host's) and the project's copies of host data to the device that do not pass `non_blocking`
    (a copy from pageable memory)."""
    import trainyard.parallel.runtime.step.step_figures as step_figures

    mode = {"warn": False}
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.update(warn=m == "warn"))
    tolist, to = torch.Tensor.tolist, torch.Tensor.to
    parallel = Path(step_figures.__file__).parents[2]
    device_code = (str(parallel / "models"), str(parallel / "runtime"))

    def synchronizing() -> None:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=3)

    def flagged_tolist(self):
        caller = sys._getframe(1).f_code.co_filename
        if mode["warn"] and caller.startswith(device_code) and caller != step_figures.__file__:
            synchronizing()
        return tolist(self)

    def flagged_to(self, *args, **kwargs):
        device = kwargs.get("device", next((a for a in args if isinstance(a, torch.device | str)), None))
        blocking = not kwargs.get("non_blocking", any(a is True for a in args))
        if mode["warn"] and device is not None and blocking and \
                sys._getframe(1).f_code.co_filename.startswith(str(parallel)):
            synchronizing()
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", flagged_tolist)
    monkeypatch.setattr(torch.Tensor, "to", flagged_to)


@slow
def test_gpu_smoke_host_read_check_counts_each_call_against_its_budget(cuda_syncs_on_the_cpu, monkeypatch, tmp_path):
    import trainyard.parallel.models.components.moe as moe
    import trainyard.parallel.runtime.pipeline.pipeline as pipeline

    import bench.gpu_smoke as smoke

    documents = smoke.write_documents(tmp_path / "documents", smoke.LLAMA.vocab_size)
    cpu = torch.device("cpu")
    monkeypatch.setattr(moe, "use_grouped_mm", lambda rows, hidden: True)  # CUDA's path on Hopper in bf16
    expected = {"host reads: llama gqa fp32": 1, "host reads: llama moe (ep 1) fp32": 1 + 2 * 2,
                "host reads: llama moe grouped bf16": 1 + 2 * 2, "host reads: llama tied, moe with capacity": 1,
                "host reads: llama packed fp32": 1}
    assert set(expected) == set(smoke.HOST_READS)
    for name, budget in expected.items():
        reads, notes = smoke.host_reads(name, cpu, documents)
        # each call: the previous step's figures and, dropless, each MoE layer's counts for each micro-batch
        assert reads["budget"] == budget and reads["per_call"] == [budget] * smoke.READ_CALLS, (name, reads)
        assert reads["flush"] == 1 and all("moe.py" in site for site in reads["sites"]), (name, reads)
    # A blocking copy of the micro-batches (as before `parallel.models.components.transfers`) is two syncs more per
    # micro-batch (the stand-in is compiled as pipeline.py's code: the stand-in of the sync debug mode flags the
    # project's copies)
    blocking = eval(compile("lambda t, device: t.to(device)", pipeline.__file__, "eval"))
    monkeypatch.setattr(pipeline, "to_device", blocking)
    with pytest.raises(AssertionError, match=r"(?s)over the host-read budget.*call 1: 4 syncs \+ 1 figure reads > 1"
                                             r".*pipeline.py:\d+ _forward"):
        smoke.host_reads("host reads: llama gqa fp32", cpu, documents)


@slow
def test_the_gpu_session_script_runs_every_part_on_a_cpu_and_leaves_what_the_device_tool_brings_back(tmp_path):
    """bench/gpu_session.sh as a GPU session runs it (its two calls' parts at once), on tiny shapes on the CPU: every
    part exits 0, $OUT holds no more than the 8 files the device tool brings back, and they record."""
    out = tmp_path / "out"
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "bench/gpu_session.sh", "smoke", "step", "compile", "profile", "big"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    parts = [line for line in (out / "summary.txt").read_text().splitlines() if " rc=" in line]
    assert [p.split(" ")[0] for p in parts] == ["smoke", "step-gpt2", "step-llama", "step-gpt2-compile",
                                                "step-llama-compile", "profile", "big"]
    assert all(" rc=0 " in p for p in parts), parts
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "session.log" in files, files
    assert len(gpu_record.rows(out)) == 11  # 4 step runs x 2 and the big run 2 (no device count on a CPU), the smoke
