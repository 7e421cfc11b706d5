"""Calibration's pure part: the node type a calibration is cached under, the cache (`calibration.json` in the
service's state directory, keyed by node type), and the machine costs fitted from what a calibration run measured.

`parallel.runtime.calibrate` measures (spawned gloo ranks, timed matmuls, collectives, optimizer steps and tiny
training runs) and hands its raw timings here: each fitted as latency + size / throughput
(`parallel.plan.planner.machine_costs.Fit`, two points, `two_point_fit`), compute's slowdown with k ranks busy
(`contention_from`, `paired_slowdowns`), the all-reduce's with more ranks than the fit's world
(`comm_contention_from`), and the trainer's fixed costs and FLOP rates from the tiny runs (`fixed_from_steps`,
`flops_from_steps`, over the runs `FIXED_RUNS` and the widths `WIDTHS` name). The service reads the cache on a
request's path (`cached_costs`), which never waits for a measurement. Pure: no torch; each fit is arithmetic a
test can feed by hand.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainyard.parallel.config import JobConfig, ModelConfig, ParallelConfig
from trainyard.parallel.plan.admission import ClusterResources
from trainyard.parallel.plan.planner.machine_costs import Fit, MachineCosts, default_gpu_costs
from trainyard.parallel.plan.sharding import sharding_for

CACHE_FILE = "calibration.json"


def node_type(cluster: ClusterResources) -> str:
    """The node type a calibration is cached under: this machine's CPU model, the nodes' CPUs and GPUs."""
    node = max(cluster.nodes, key=lambda n: (n.gpus, n.cpus)) if cluster.nodes else None
    cpus = f"{node.cpus:g}" if node else "?"
    gpus = f", {node.gpus:g} GPU of {node.gpu_memory / 2**30:.0f} GiB" if node and node.gpus else ""
    return f"{_cpu_model()} x{cpus} CPU{gpus}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cached_costs(state_dir: Path, cluster: ClusterResources) -> MachineCosts | None:
    """The cluster's node type's costs if they need no measuring (cached, or a GPU node type's defaults), else
    None: what the service asks on a request's path, which must not wait for a measurement."""
    key = node_type(cluster)
    cache = _read_cache(state_dir)
    if key in cache:
        return MachineCosts.from_dict(cache[key])
    if cluster.gpus > 0:
        return default_gpu_costs(key)
    return None


def store_costs(state_dir: Path, key: str, costs: MachineCosts) -> None:
    """Cache `costs` for node type `key`, atomically: a request reading the cache meanwhile (`cached_costs`)
    sees the file before or after, never half of it."""
    path = Path(state_dir) / CACHE_FILE
    cache = _read_cache(state_dir)
    cache[key] = costs.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(cache, indent=2))
    os.replace(tmp, path)


def _read_cache(state_dir: Path) -> dict:
    path = Path(state_dir) / CACHE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def contention_from(together: list[float], cores: int) -> tuple[float, ...]:
    """Compute's slowdown with k = 1, 2, ... ranks busy (index k - 1) from the slowest busy rank's time with k
    busy, over the time alone: at least k / cores, since k one-threaded ranks on `cores` cores cannot each have
    more than cores / k of one. The timed bursts are milliseconds long, and the barrier releases the ranks a
    little apart, so their lower quartile can catch ranks that hardly overlapped: 4 ranks on this machine's 2
    cores once measured 1.52, and the planner then chose dp=4, measured 1.6x slower than the dp=2 it ranked
    second (BENCHMARKS.md, section `planner`)."""
    alone = together[0]
    return tuple(max(t / alone, k / cores, 1.0) for k, t in enumerate(together, start=1))


def comm_contention_from(costs: MachineCosts, at_k: dict[int, list]) -> tuple[float, ...]:
    """Per rank count k (index k - 1): the median over sizes of the all-reduce's time measured with k ranks over
    what the `world`-rank fit predicts for k (1 up to `world`); () when nothing past `world` was measured."""
    if not at_k:
        return ()
    out = [1.0] * costs.world
    for k in sorted(at_k):
        out.append(max(statistics.median(t / costs.collective("allreduce", size, k) for size, t in at_k[k]), 1.0))
    return tuple(out)


TINY_MODEL: dict[str, Any] = {"n_head": 2, "d_model": 16, "vocab_size": 64, "seq_len": 8}
"""The tiny models whose steps are all fixed cost (their FLOPs take microseconds)."""
TINY_BATCH, FIXED_STEPS, FIXED_REPEATS = 8, 6, 3
ONE_RANK = {"L2 m1": (2, 1), "L2 m4": (2, 4), "L4 m2": (4, 2), "L8 m1": (8, 1), "L8 m4": (8, 4)}
"""Tiny one-rank runs: name -> (blocks, micro-batches); their step times are fitted as step + m x (micro-batch +
blocks x block) by least squares."""
ZERO_FIXED_LEVELS = (2, 3)
"""The sharding levels whose fixed cost over plain data parallelism is measured (FSDP2's: hooks, copies, the
optimizer's step on DTensors; ZeRO-1's hand-written reducer costs what its collectives and copies cost)."""
FIXED_RUNS: dict[str, tuple[int, dict]] = {
    **{name: (blocks, {"microbatches": m}) for name, (blocks, m) in ONE_RANK.items()},
    "L4 m2 tp2": (4, {"microbatches": 2, "tp": 2}),
    "L4 m2 tp2 sp": (4, {"microbatches": 2, "tp": 2, "sp": True}),
    "L2 m2 pp2": (2, {"microbatches": 2, "pp": 2}),
    "L2 m8 pp2": (2, {"microbatches": 8, "pp": 2}),
    "L2 m1 dp2": (2, {"dp": 2}),
    **{f"L{blocks} m{m} dp2 zero{z}": (blocks, {"dp": 2, "microbatches": m, "zero": z})
       for z in ZERO_FIXED_LEVELS for blocks, m in ((2, 1), (8, 1), (8, 4))},
}
"""name -> (blocks, parallel options) of the tiny runs `measure_fixed` times; its arithmetic reads them."""
WIDTHS = (128, 256, 512)
"""The widths (d_model) of the one-rank runs whose FLOP rate is measured: 2 blocks, 16 sequences of 32 tokens (at
narrower widths the fixed costs outweigh the FLOPs, and the rate is lost in their noise)."""
WIDE_VOCAB, WIDE_SEQ, WIDE_BATCH = 1024, 32, 16
TOKENS_WIDTH, TOKENS = 256, (64, 128)
"""The width and the token counts (per micro-batch, fewer than the widths' 512) whose FLOP rate is measured
against the width's at 512: thinner matmuls run slower."""


def flops_from_steps(costs: MachineCosts, step: dict[str, float]) -> MachineCosts:
    """The rate the trainer runs a model's FLOPs at, per width (`MachineCosts.model_flops`) and, at one width,
    per token count of a micro-batch (`token_efficiency`): each run's FLOPs over its step time less the fixed
    costs and the optimizer's step (pure arithmetic)."""
    from trainyard.parallel.models import family_of
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.plan.memory.estimate import param_counts

    def rate(config: JobConfig, name: str) -> float:
        m = config.model
        flops = family_of(m).flops_per_token(m) * config.global_batch * m.seq_len
        fixed = costs.step_s + costs.microbatch_s + m.n_layer * costs.block_s
        params = param_counts(make_plan(config), 0).total
        return flops / max(step[name] - fixed - costs.optimizer.time(params), 1e-9)

    widths = tuple((float(d), rate(wide_config(d), f"width {d}")) for d in WIDTHS)
    base = rate(wide_config(TOKENS_WIDTH), f"width {TOKENS_WIDTH}")
    tokens = tuple((float(t), min(rate(wide_config(TOKENS_WIDTH, t // WIDE_SEQ), f"width {TOKENS_WIDTH} tokens {t}")
                                  / base, 1.0)) for t in TOKENS)  # never faster than the widths' (noise)
    return replace(costs, model_flops=widths, token_efficiency=(*tokens, (float(WIDE_BATCH * WIDE_SEQ), 1.0)))


def fixed_from_steps(costs: MachineCosts, step: dict[str, float], backward_share: float) -> MachineCosts:
    """The fixed-cost terms from the tiny runs' step times (FIXED_RUNS' names; pure arithmetic)."""
    fixed_step, microbatch, block = _least_squares([((1.0, m, m * blocks), step[name])
                                                    for name, (blocks, m) in ONE_RANK.items()])
    block, microbatch = max(block, 0.0), max(microbatch, 0.0)
    fixed_step = max(fixed_step - costs.optimizer.time(tiny_params(2)), 0.0)

    def one_rank(blocks: int, m: int) -> float:
        return fixed_step + m * (microbatch + blocks * block)

    slow = costs.slowdown(2)
    act = TINY_BATCH // 2 * TINY_MODEL["seq_len"] * TINY_MODEL["d_model"] * 4
    tp_block = max((step["L4 m2 tp2"] / slow - one_rank(4, 2)) / 8 - 4 * costs.collective("allreduce", act, 2), 0.0)
    sp_block = max((step["L4 m2 tp2 sp"] - step["L4 m2 tp2"]) / slow / 8, 0.0)
    # pp = 2, one block a stage: each more micro-batch adds one chunk's forward and backward on each stage's
    # critical path, and its hand-overs
    pp_micro = max((step["L2 m8 pp2"] - step["L2 m2 pp2"]) / slow / 6 - (microbatch + block)
                   - 2 * costs.p2p.time(act), 0.0)
    # dp = 2 at the same micro-batch size: the gradient reduction's fixed cost beyond its all-reduce (buckets,
    # hooks, waiting for the peer), per step
    grads = 4 * tiny_params(2)
    dp_step = max((step["L2 m1 dp2"] - costs.collective("allreduce", grads, 2)) / slow - one_rank(2, 1), 0.0)
    # a sharding level at dp = 2: what its runs take beyond plain data parallelism's fixed costs and the level's
    # own collectives (its reductions and gathers), fitted as blocks x (per step + m x per micro-batch)
    zero_fixed = {}
    for z in ZERO_FIXED_LEVELS:
        sharding, rows = sharding_for(z), []
        for name, (blocks, par) in FIXED_RUNS.items():
            if par.get("zero") != z:
                continue
            m = par["microbatches"]
            colls = (m if sharding.reduces_every_microbatch else 1) * costs.collective(
                sharding.gradient_collective, 4 * tiny_params(blocks), 2) + sharding.gathers_per_step(m) * \
                costs.collective("allgather", 4 * tiny_params(blocks), 2)
            rows.append(((blocks, blocks * m), (step[name] - colls) / slow - one_rank(blocks, m) - dp_step))
        per_step, per_microbatch = _least_squares(rows)
        zero_fixed[str(z)] = (max(per_step, 0.0), max(per_microbatch, 0.0))
    return replace(costs, block_s=block, microbatch_s=microbatch, step_s=fixed_step, tp_block_s=tp_block,
                   sp_block_s=sp_block, pp_microbatch_s=pp_micro, dp_step_s=dp_step, zero_fixed=zero_fixed,
                   backward_share=min(max(backward_share, 0.0), 1.0),
                   measured={**costs.measured, "fixed_steps": step})


def _least_squares(rows: Sequence[tuple[tuple[float, ...], float]]) -> tuple[float, ...]:
    """x minimising |A x - b| for rows (A's row, b) (normal equations, Gauss-Jordan; a few unknowns)."""
    n = len(rows[0][0])
    ata = [[sum(a[i] * a[j] for a, _ in rows) for j in range(n)] + [sum(a[i] * b for a, b in rows)]
           for i in range(n)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(ata[r][c]))
        ata[c], ata[pivot] = ata[pivot], ata[c]
        for r in range(n):
            if r != c and ata[c][c]:
                f = ata[r][c] / ata[c][c]
                ata[r] = [x - f * y for x, y in zip(ata[r], ata[c], strict=True)]
    return tuple(ata[i][n] / ata[i][i] if ata[i][i] else 0.0 for i in range(n))


def wide_config(d_model: int, batch: int = WIDE_BATCH) -> JobConfig:
    model = ModelConfig(n_layer=2, n_head=4, d_model=d_model, vocab_size=WIDE_VOCAB, seq_len=WIDE_SEQ)
    return JobConfig(model=model, steps=FIXED_STEPS, global_batch=batch)


def tiny_config(blocks: int, par: dict) -> JobConfig:
    return JobConfig(model=ModelConfig(n_layer=blocks, **TINY_MODEL), steps=FIXED_STEPS, global_batch=TINY_BATCH,
                     parallel=ParallelConfig(**par))


def tiny_params(blocks: int) -> int:
    d, v, t = TINY_MODEL["d_model"], TINY_MODEL["vocab_size"], TINY_MODEL["seq_len"]
    return blocks * 12 * d * d + 2 * v * d + t * d


def two_point_fit(points: list[list[float]]) -> Fit:
    """The latency from the two smallest sizes (the lesser: a burst of load only adds time), the throughput the
    slope from there to the largest."""
    (small_size, _), (large_size, large) = points[0], points[-1]
    latency = min(t for _, t in points[:2])
    return Fit(latency_s=latency, per_s=(large_size - small_size) / max(large - latency, 1e-12))


def quartile(values) -> float:
    """The lower quartile: on a shared machine interference only adds time, and it comes in bursts; the lower
    quartile is the undisturbed cost without resting on the one luckiest run (the minimum)."""
    values = sorted(values)
    at = (len(values) - 1) / 4
    low = int(at)
    return values[low] + (values[min(low + 1, len(values) - 1)] - values[low]) * (at - low)


def paired_slowdowns(rounds: list[list[float]]) -> list[float]:
    """Per k (index k - 1): the median over rounds of k ranks' time over the same round's one rank alone. Paired
    within a round, the machine's drift (up to 20% within a minute on this VM) cancels; lower quartiles of each k's
    times apart would keep it."""
    return [statistics.median(r[k] / r[0] for r in rounds) for k in range(len(rounds[0]))]
