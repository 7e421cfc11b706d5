"""`bench.proc_cpu`, the CPU-by-process sampler the suite's time was analysed with: it finds a child's CPU."""

from __future__ import annotations

import sys

from bench.proc_cpu import _name, measure

BUSY = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end:\n    pass"


def test_a_busy_child_is_counted_with_its_cpu_seconds():
    command = [sys.executable, "-c", BUSY]
    code, groups = measure(command, interval_s=0.05)
    assert code == 0
    count, cpu = groups[_name(" ".join(command))]
    assert count == 1 and 0.4 <= cpu <= 2.0


def test_ray_workers_are_one_group_whatever_actor_they_took():
    assert _name("/venv/bin/python /venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py "
                 "--node-ip-address=1.2.3.4") == _name("ray::IDLE") == "Ray worker processes"
    assert _name("ray::Coordinator.poll") == "ray::Coordinator.poll"
