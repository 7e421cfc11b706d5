"""Context parallelism: each rank's measured activation peak at cp=2 and cp=4 against cp=1 at the same length, the
memory plan's figure beside it, and each rank's attention compute at cp=4 (head-tail balance).

Run: `python -m bench.run --only cp`; spawned gloo ranks on this machine, no Ray. A llama with grouped-query
attention (2 blocks, d_model 64, 4 query and 2 kv heads, seq_len 2048, one sequence per step) trains one step at
cp=1, 2 and 4 in one spawned world. Each rank's executor meters the bytes autograd holds for backward at once
(`peak_activation_bytes`, parameters excluded); the plan's figure is `estimate(...)[rank].activations`. Then every
rank of the cp=4 run times its own attention blocks (`parallel.runtime.cp.ring.block_attention` over the blocks its
mask allows, forward only, one thread, transfers excluded: in the ring a rank waits for its peers, so its wall time says
nothing of its own share), one rank at a time: head-tail chunks should make the four equal.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.memory.estimate import estimate
from trainyard.parallel.runtime.cp.chunks import local_indices
from trainyard.parallel.runtime.cp.ring import Mask, block_attention
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.local_world import PlanRun, run_plans
from trainyard.parallel.spec import parse_spec

from bench.context import BenchContext
from bench.results import Row, Target, ratio

SEQ = 2048
SPEC = {
    "name": "bench-cp",
    "seed": 1234,
    "model": {"family": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64, "ffn_hidden": 128,
              "vocab_size": 256, "seq_len": SEQ},
    "data": {"kind": "synthetic"},
    "steps": 1,
    "global_batch": 1,
    "resources": {"gpus_per_worker": 0},
}
DEGREES = (1, 2, 4)
ROUNDS = 15


def attention_seconds(driver: RankDriver, stats: list[dict]) -> float:
    """The fastest of ROUNDS timings of this rank's attention blocks (every block its mask allows, one layer's
    shapes)."""
    trainer = driver.trainer
    cp, me = trainer.plan.cp, trainer.coords.cp
    m = trainer.plan.config.model
    indices = [local_indices(SEQ, r, cp) for r in range(cp)]
    mask = Mask(indices)
    t = SEQ // cp
    q, k, v = (torch.randn(1, m.n_head, t, m.head_size) for _ in range(3))
    times, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # the same on every rank (spawned ranks' thread pools differ in size)
    for _ in range(ROUNDS):  # rounds outer, turns inner: load that comes and goes falls on every rank alike
        for turn in range(cp):  # one rank at a time: the ranks share this machine's cores
            dist.barrier(group=trainer.groups.cp)
            if turn == me:
                start = time.perf_counter()
                for src in range(cp):
                    allowed = mask.block(me, src)
                    if allowed is not None:
                        block_attention(q, k, v, allowed)
                times.append(time.perf_counter() - start)
    dist.barrier(group=trainer.groups.cp)
    torch.set_num_threads(threads)
    return min(times)  # the fastest round: other load on the shared cores only adds


def measure() -> dict[int, dict]:
    plans = {cp: make_plan(parse_spec({**SPEC, "parallel": {"cp": cp}})) for cp in DEGREES}
    runs = [PlanRun(plan, probe=attention_seconds if cp > 1 else None) for cp, plan in plans.items()]
    out = {}
    for cp, ranks in zip(plans, run_plans(runs), strict=True):
        planned = estimate(plans[cp].layout, plans[cp].config)
        out[cp] = {"measured": [r.stats[0]["peak_activation_bytes"] / 2**20 for r in ranks],
                   "planned": [p.activations / 2**20 for p in planned], "attention_s": [r.probe for r in ranks],
                   "losses": [r.stats[0]["loss"] for r in ranks]}
    return out


def run_section(ctx: BenchContext) -> list[Row]:
    got = measure()
    for cp, figures in got.items():
        ctx.log(f"cp={cp}: measured peak per rank {[round(x, 2) for x in figures['measured']]} MB, planned "
                f"{[round(x, 2) for x in figures['planned']]} MB, attention s {figures['attention_s']}")
    base = got[1]["measured"][0]
    m = SPEC["model"]
    note = (f"llama GQA {m['n_head']}/{m['n_kv_head']} heads, d_model {m['d_model']}, {m['n_layer']} blocks, "
            f"seq_len {SEQ}, one sequence per step, fp32; baseline cp=1 at the same length")
    rows = []
    for cp in DEGREES[1:]:
        peak = max(got[cp]["measured"])
        rows.append(Row(f"cp={cp}: largest rank's peak activation memory vs cp=1 (MB)", peak, base,
                        ratio(peak, base), "MB", note + f"; 1/cp = {1 / cp:.3f}", target=Target("ratio", "<=",
                                                                                                1.1 / cp)))
        planned = max(got[cp]["planned"])
        rows.append(Row(f"cp={cp}: memory plan's activations vs the measured peak (MB)", planned, peak,
                        ratio(planned, peak), "MB", note))
    times = got[4]["attention_s"]
    rows.append(Row("cp=4: slowest vs fastest rank's attention compute (s)", max(times), min(times),
                    ratio(max(times), min(times)), "s",
                    note + f"; each rank's own blocks, transfers excluded, fastest of {ROUNDS}",
                    target=Target("ratio", "<=", 1.1)))
    return rows


def main() -> None:
    for cp, figures in measure().items():
        print(cp, figures)


if __name__ == "__main__":
    main()
