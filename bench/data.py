"""Section "data": `trainyard prepare` throughput, and the data loader against what a training step consumes.

Run: `python -m bench.run --only data` (about a minute on 2 cores); torch, tokenizers and gloo in this
process, no Ray.

- prepare: DOCS JSONL documents (the paragraphs of examples/corpus.txt, each prefixed with its number so no
  two are alike) tokenized with examples/tokenizer into a dataset directory, at 1 worker and at one per core
  (`parallel.data.prepare.prepare`, as `trainyard prepare` runs it: reading, hashing, tokenizing, EOS, shards,
  manifest). Baseline: tokenizers' `encode_batch` of the same texts in this process, alone (Rust, its own
  threads; what prepare spends its time on, with nothing read or written).
- loader: per data-parallel rank of a dp=2 job (global batch GLOBAL_BATCH, seq_len SEQ_LEN), the time to read
  its micro-batches of a step (`load_batch` of its share; for chat data also the step's counted targets of
  the whole global batch, which every rank works out), as tokens/s, for the prepared directory, a mixture of
  it and a chat directory, and the chat directory alone. Baseline: the tokens a rank's step consumes per
  second: its share of the batch over the step time of MODEL with that share (one rank, in process, gloo;
  the dp all-reduce left out, so the baseline is the faster side). The ratio is the loader's headroom.
Each time is the median of ROUNDS repetitions.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from trainyard.parallel.data.datasets import load_batch, open_dataset, step_counted_targets
from trainyard.parallel.data.prepare import PrepareOptions, default_workers, prepare
from trainyard.parallel.data.sampler import global_batch_ids, rank_share
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.spec import parse_spec

from bench.context import REPO, BenchContext
from bench.machine import busy_fraction
from bench.results import Row, ratio
from bench.service_job import free_port

DOCS = 20_000
ROUNDS = 5
LOADER_STEPS = 50
GLOBAL_BATCH, SEQ_LEN, DP = 16, 256, 2
MODEL = {"n_layer": 6, "n_head": 6, "d_model": 384, "vocab_size": 1024, "seq_len": SEQ_LEN}
TOKENIZER = REPO / "examples" / "tokenizer"


def _corpus(path: Path) -> list[str]:
    paragraphs = [p for p in (REPO / "examples" / "corpus.txt").read_text().split("\n\n") if p.strip()]
    docs = [f"{i}. {paragraphs[i % len(paragraphs)]}" for i in range(DOCS)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def _median_s(fn, rounds: int = ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _prepare_rows(ctx: BenchContext, root: Path) -> tuple[list[Row], Path]:
    from tokenizers import Tokenizer

    docs = _corpus(root / "docs.jsonl")
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    tokens = sum(len(e.ids) + 1 for e in tok.encode_batch(docs, add_special_tokens=False))
    raw_s = _median_s(lambda: tok.encode_batch(docs, add_special_tokens=False))
    rows, out = [], root / "prepared"
    for workers in sorted({1, default_workers()}):
        def run(workers: int = workers) -> None:
            target = root / f"w{workers}"  # a fresh directory each time: an existing one would be a no-op
            shutil.rmtree(target, ignore_errors=True)
            prepare([root / "docs.jsonl"], target, TOKENIZER, PrepareOptions(shard_tokens=1 << 20),
                    workers=workers, progress=False)

        seconds = _median_s(run, rounds=3)
        ctx.log(f"prepare, {workers} worker(s): {tokens / seconds:,.0f} tokens/s ({seconds:.2f} s for {tokens} tokens)")
        rows.append(Row(f"prepare tokens/s, {workers} worker(s) vs tokenizers encode_batch alone", tokens / seconds,
                        tokens / raw_s, ratio(raw_s, seconds), "tokens/s",
                        f"{DOCS} JSONL documents, {tokens} tokens, examples/tokenizer (1024 ids); baseline: "
                        "encode_batch in this process (no reading, hashing or writing)"))
    (root / "w1").rename(out)
    return rows, out


def _step_tokens_per_s(ctx: BenchContext, data: dict) -> float:
    """Tokens per second one data-parallel rank's step consumes: its share through MODEL, one rank in process."""
    share = GLOBAL_BATCH // DP
    plan = make_plan(parse_spec({"model": MODEL, "data": data, "steps": LOADER_STEPS, "global_batch": share,
                                 "seed": 1, "resources": {"gpus_per_worker": 0}}))
    driver = RankDriver(plan, 0, "127.0.0.1", free_port(), torch.device("cpu"), timeout_s=300)
    try:
        n = open_dataset(plan.config).num_samples
        times = []
        for step in range(1 + ROUNDS):
            ids = global_batch_ids(1, step, share, n)
            t0 = time.perf_counter()
            driver.step(step, [ids])
            times.append(time.perf_counter() - t0)
    finally:
        driver.close()
    seconds = statistics.median(times[1:])
    ctx.log(f"step of {share} x {SEQ_LEN} tokens: {seconds:.3f} s")
    return share * SEQ_LEN / seconds


def _loader_tokens_per_s(data: dict) -> float:
    cfg = parse_spec({"model": MODEL, "data": data, "steps": LOADER_STEPS, "global_batch": GLOBAL_BATCH})
    ds = open_dataset(cfg)

    def one_pass() -> None:
        for step in range(LOADER_STEPS):
            ids = global_batch_ids(cfg.seed, step, GLOBAL_BATCH, ds.num_samples)
            step_counted_targets(cfg, ds, step)  # every rank's per-step count (a loop over no mask: cheap)
            for mb in rank_share(ids, 0, DP, 1):
                load_batch(ds, mb)

    return LOADER_STEPS * GLOBAL_BATCH // DP * SEQ_LEN / _median_s(one_pass)


def run_section(ctx: BenchContext) -> list[Row]:
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    busy = busy_fraction() or 0.0
    ctx.log(f"machine {100 * busy:.0f}% busy before the run (others' load; high means noisy timings)")
    with tempfile.TemporaryDirectory(dir=ctx.run_dir) as tmp:
        root = Path(tmp)
        rows, prepared = _prepare_rows(ctx, root)
        prepare([REPO / "examples" / "finetune.jsonl"], root / "chat", TOKENIZER, PrepareOptions(chat=True),
                progress=False)
        base = {"kind": "tokens", "path": str(prepared)}
        consumed = _step_tokens_per_s(ctx, base)
        datasets = {
            "prepared directory": base,
            "mixture of 2 (3:1, one chat)": {"kind": "tokens", "sources": [
                {"path": str(prepared), "weight": 3}, {"path": str(root / "chat"), "weight": 1}]},
            "chat directory (mask)": {"kind": "tokens", "path": str(root / "chat")},
        }
        m = MODEL
        note = (f"per rank of dp={DP}, global batch {GLOBAL_BATCH} x seq_len {SEQ_LEN}; baseline: tokens/s a rank's "
                f"step consumes (GPT {m['n_layer']} blocks, d_model {m['d_model']}, vocab {m['vocab_size']}, fp32, "
                "1 thread); ratio = headroom")
        for name, data in datasets.items():
            loaded = _loader_tokens_per_s(data)
            ctx.log(f"loader, {name}: {loaded:,.0f} tokens/s per rank vs {consumed:,.0f} consumed")
            rows.append(Row(f"loader tokens/s per rank, {name} vs a step's consumption", loaded, consumed,
                            ratio(loaded, consumed), "tokens/s", note))
    return rows
