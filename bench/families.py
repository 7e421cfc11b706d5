"""Section "families": a llama step against a gpt2 step of (nearly) the same parameter count.

Run: `python -m bench.run --only families` (about a minute on 2 cores); torch and gloo in this process, no Ray.

One rank (fp32, one thread), in process: a `RankDriver` for the gpt2 model and a second trainer on its process
group for the llama model (`RankDriver.trainer_for`), their steps interleaved so both see the same machine.
The two models have the same depth, width and heads; llama's SwiGLU width is 8/3 of d_model (three matrices
where gpt2's GELU MLP has two of 4 x d_model), so their block parameters are equal and the totals differ only by
gpt2's position embedding and biases. Each time is the median of ROUNDS steps after one warm-up step.
"""

from __future__ import annotations

import statistics
import time

import torch
from trainyard.parallel.data.datasets import open_dataset
from trainyard.parallel.data.sampler import global_batch_ids
from trainyard.parallel.models import family_of
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.spec import parse_spec

from bench.context import REPO, BenchContext
from bench.results import Row, ratio
from bench.service_job import free_port

ROUNDS = 8
GLOBAL_BATCH, SEQ_LEN = 8, 256
BASE = {"n_layer": 6, "n_head": 6, "d_model": 384, "vocab_size": 256, "seq_len": SEQ_LEN}
MODELS = {"gpt2": {**BASE, "family": "gpt2"},
          "llama": {**BASE, "family": "llama", "ffn_hidden": 8 * BASE["d_model"] // 3}}


def _plan(model: dict) -> Plan:
    return make_plan(parse_spec({"model": model, "steps": 1 + ROUNDS, "global_batch": GLOBAL_BATCH,
                                 "data": {"kind": "text", "path": str(REPO / "examples" / "corpus.txt")}}))


def parameters(plan: Plan) -> int:
    cfg = plan.config.model
    return family_of(cfg).param_counts(cfg, range(cfg.n_layer), first=True, last=True, tp=1, ep=1).total


def run_section(ctx: BenchContext) -> list[Row]:
    torch.set_num_threads(1)
    plans = {name: _plan(model) for name, model in MODELS.items()}
    rounds = 2 if ctx.quick else ROUNDS
    driver = RankDriver(plans["gpt2"], 0, "127.0.0.1", free_port(), torch.device("cpu"), timeout_s=300)
    try:
        trainers = {"gpt2": driver.trainer, "llama": driver.trainer_for(plans["llama"])}
        n = open_dataset(plans["gpt2"].config).num_samples
        times: dict[str, list[float]] = {name: [] for name in plans}
        for step in range(1 + rounds):
            ids = global_batch_ids(0, step, GLOBAL_BATCH, n)
            for name, trainer in trainers.items():  # interleaved: both see the same machine
                start = time.perf_counter()
                trainer.train_step(step, [ids])
                times[name].append(time.perf_counter() - start)
    finally:
        driver.close()
    seconds = {name: statistics.median(t[1:]) for name, t in times.items()}
    params = {name: parameters(plan) for name, plan in plans.items()}
    for name in plans:
        ctx.log(f"{name}: {params[name]:,} parameters, {seconds[name]:.3f} s per step")
    note = (f"one rank, fp32, 1 thread; {BASE['n_layer']} blocks, d_model {BASE['d_model']}, {BASE['n_head']} heads, "
            f"batch {GLOBAL_BATCH} x {SEQ_LEN}; parameters llama {params['llama']:,}, gpt2 {params['gpt2']:,}; "
            f"median of {rounds} steps")
    return [Row("step time, llama vs gpt2 at equal parameter count", seconds["llama"], seconds["gpt2"],
                ratio(seconds["llama"], seconds["gpt2"]), "s", note)]
