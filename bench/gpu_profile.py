"""`python -m bench.gpu_profile [bench.gpu's options]`: torch.profiler over 5 steps of trainyard's trainer and of
the plain loop (bench.gpu's sides, after 5 warm-up steps each): wall time per step, the kernels' summed time,
the top CPU and device ops, and each side's Chrome trace (gzipped) in $OUT (default /tmp). How BENCHMARKS.md's
"where trainyard's 25 ms go" was measured; `--tiny --device cpu` checks the code path."""

from __future__ import annotations

import gzip
import os
import shutil
import time

from torch.profiler import ProfilerActivity, profile

import bench.gpu as g


def main(argv: list[str] | None = None) -> None:
    setup = g.setup_from_args(argv)
    out = os.environ.get("OUT", "/tmp")
    side, _, _ = g._trainyard_side(setup.plan, setup.device, setup.shares)
    batches = g.device_batches(g.open_dataset(setup.plan.config), setup.device, setup.shares)
    plain = g._plain_side(setup.plan.config, setup.device, setup.plan.config.precision, batches, g.PLAIN)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device.type == "cuda" else [])
    for s in (side, plain):
        for i in range(5):
            s.step(i)
        setup.sync()
    for s in (side, plain):
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for i in range(5, 10):
                s.step(i)
            setup.sync()
            wall = time.perf_counter() - start
        ops = prof.key_averages()
        device_ms = sum(e.self_device_time_total for e in ops) / 1e3
        print(f"\n===== {s.name}: wall {wall * 1e3 / 5:.1f} ms/step, device ops' self time {device_ms / 5:.1f} ms/step")
        print(ops.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(ops.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
        path = f"{out}/trace_{s.name}.json"
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
            shutil.copyfileobj(f, z)
        os.remove(path)
    g.shutdown_distributed()


if __name__ == "__main__":
    main()
