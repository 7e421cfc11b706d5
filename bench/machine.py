"""What machine the benchmarks ran on: cores, CPU model, memory, and the versions that matter.

Read at run time (never hard-coded), printed by bench.run and stored in results.json next to the rows.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "ram_gib": _ram_gib(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "ray": _version("ray"),
        "os": platform.platform(),
    }


def describe(info: dict[str, Any]) -> str:
    ram = f"{info['ram_gib']:.1f} GiB RAM" if info.get("ram_gib") is not None else "RAM unknown"
    return (f"{info['nproc']} cores (nproc), {info['cpu_model']}, {ram}; python {info['python']}, "
            f"torch {info['torch']}, ray {info['ray']}; {info['os']}")


def _cpu_model() -> str:
    """`lscpu | grep 'Model name'`, else /proc/cpuinfo, else what platform knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _ram_gib() -> float | None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)  # kB -> GiB
    return None


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def busy_fraction(seconds: float = 1.0) -> float | None:
    """Share of all cores busy over `seconds` (from /proc/stat, which counts every process on the host, also
    those of other containers). Read while nothing of the benchmark runs, it measures the load of others."""
    first = _cpu_ticks()
    if first is None:
        return None
    time.sleep(seconds)
    second = _cpu_ticks()
    assert second is not None
    total, idle = second[0] - first[0], second[1] - first[1]
    return 1.0 - idle / total if total > 0 else None


def _cpu_ticks() -> tuple[int, int] | None:
    """(all ticks, idle + iowait ticks) of the aggregate `cpu` line of /proc/stat."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return None
    values = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
    return sum(values), values[3] + values[4]
