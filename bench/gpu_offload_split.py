"""`python -m bench.gpu_offload_split [bench.gpu's options]`: the offload's step cost split: trainyard's trainer
with no offload, with `optimizer.offload` alone and with `activation_offload` alone (4 steps each after 2), then
one host AdamW step over the model's parameters with torch's foreach and fused CPU kernels. How BENCHMARKS.md's
offload table was measured; `--tiny --device cpu` checks the code path."""

from __future__ import annotations

import dataclasses
import time

import torch

import bench.gpu as g


def main(argv: list[str] | None = None) -> None:
    setup = g.setup_from_args(argv)
    cfg = setup.plan.config
    base, driver, _ = g._trainyard_side(setup.plan, setup.device, setup.shares)
    sides = {"no offload": base}
    for name, variant in (
            ("optimizer.offload", dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, offload=True))),
            ("activation_offload", dataclasses.replace(cfg, activation_offload=True))):
        sides[name] = g._trainyard_side(g.make_plan(variant), setup.device, setup.shares, driver, name)[0]
    for name, side in sides.items():
        for i in range(2):
            side.step(i)
        setup.sync()
        start = time.perf_counter()
        for i in range(2, 6):
            side.step(i)
        setup.sync()
        print(f"{name}: {(time.perf_counter() - start) / 4 * 1e3:.1f} ms/step", flush=True)
    g.shutdown_distributed()
    params = [torch.nn.Parameter(p.detach().float().cpu().clone()) for p in base.model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    print(f"host AdamW over {sum(p.numel() for p in params) / 1e6:.1f}M fp32 parameters, "
          f"{torch.get_num_threads()} threads:")
    for kernel in ("foreach", "fused"):
        optimizer = torch.optim.AdamW(params, lr=1e-4, **{kernel: True})
        optimizer.step()
        start = time.perf_counter()
        for _ in range(3):
            optimizer.step()
        print(f"  {kernel}: {(time.perf_counter() - start) / 3 * 1e3:.1f} ms/step", flush=True)


if __name__ == "__main__":
    main()
