"""bench/gpu.py's tiny CPU mode: the GPU benchmark's code path runs and reports its numbers (no timing claims)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_record
from bench.report import render
from bench.results import Row

REPO = Path(__file__).resolve().parents[2]


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
