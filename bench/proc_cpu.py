"""Where a command's CPU goes: the CPU seconds of every process that ran while it ran, grouped by name.

Run: `python -m bench.proc_cpu -- .venv/bin/python -m pytest -q tests/e2e/test_faults_http.py`. Samples /proc
(Linux) every 0.2 s while the command runs, and prints per process name (the first command line seen for it;
Ray's workers as one group) how many processes ran and their CPU seconds,
minus what processes that were already running had used before. A process that starts and ends between two
samples is missed: the figures are a lower bound, good for the large items (the test suite's Ray workers).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def _name(cmdline: str) -> str:
    """A process's group: Ray's workers as one (their command line changes as they take an actor), else the first
    45 characters of the command line."""
    if "default_worker.py" in cmdline or cmdline.startswith("ray::IDLE"):
        return "Ray worker processes"
    return cmdline[:45]


def _sample() -> dict[str, tuple[float, str]]:
    """pid -> (CPU seconds so far, its group's name)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = _name(f.read().replace(b"\0", b" ").decode(errors="replace"))
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = ((int(fields[11]) + int(fields[12])) / HZ, cmd)
    return out


def measure(command: list[str], interval_s: float = 0.2) -> tuple[int, dict[str, list[float]]]:
    """The command's exit code, and name -> [processes, CPU seconds] of every process seen while it ran."""
    before = {pid: cpu for pid, (cpu, _) in _sample().items()}
    used: dict[str, float] = {}
    names: dict[str, str] = {}
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        for pid, (cpu, cmd) in _sample().items():
            used[pid] = max(used.get(pid, 0.0), cpu)
            if cmd:
                names.setdefault(pid, cmd)
        time.sleep(interval_s)
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for pid, cpu in used.items():
        spent = cpu - before.get(pid, 0.0)
        if spent > 0.01:
            group = groups[names.get(pid, "?")]
            group[0] += 1
            group[1] += spent
    return proc.returncode, dict(groups)


def main(argv: list[str]) -> int:
    command = argv[argv.index("--") + 1:] if "--" in argv else argv
    if not command:
        print(__doc__)
        return 2
    start = time.perf_counter()
    code, groups = measure(command)
    wall = time.perf_counter() - start
    total = sum(cpu for _, cpu in groups.values())
    print(f"{wall:.1f} s wall, {total:.1f} CPU-s in all ({total / wall:.2f} cores busy on average)")
    print(f"{'CPU-s':>8} {'procs':>5}  name")
    for name, (count, cpu) in sorted(groups.items(), key=lambda item: -item[1][1])[:20]:
        print(f"{cpu:8.1f} {count:5d}  {name}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
