"""Section "checkpoint": how long a checkpoint save blocks the step loop, sync vs async, and save/load speed.

Run: `python -m bench.run --only checkpoint`; spawned gloo ranks on this machine (torch alone, no Ray); about
30 s on 2 idle cores.

Two ranks (dp=2, one torch thread each) train one `RankTrainer` on synthetic data; after WARMUP_STEPS steps
(so AdamW's moments exist) and one discarded save of each kind, every round does, in an order that rotates
from round to round (so drift of the machine hits every part alike), each after a barrier:
- `sync`: `save_checkpoint(background=False)`, then rank 0 re-hashes the committed checkpoint
  (`parallel.io.checkpoint.verify`, the SHA-256 of every file that `commit` computes too);
- `async`: `save_checkpoint(background=True)` (blocks while DCP stages the state), then `finish_checkpoint()`
  at once (waits for the background write and commits);
- `overlap`: the same async save, then STEPS_IN_FLIGHT training steps while it is written, then
  `finish_checkpoint()` (what is left of the write);
- `plain`: STEPS_IN_FLIGHT training steps with nothing in flight (the step times `overlap` is read against);
and then, on the same trainers, `load_checkpoint` of the round's sync checkpoint twice, in alternating order:
`warm` (its files in the page cache) and `cold` (each file dropped from the page cache first with
POSIX_FADV_DONTNEED, which works on clean pages without root).

A save is collective and rank 0 also commits (hashes every file, writes the manifest, renames), so the step
loop is blocked until the slower rank returns: every time of a round is the slower rank's. The rows are
medians over rounds; the throughputs divide the committed directory's bytes (the sum of its files' sizes)
by the median time.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from trainyard.parallel.io.checkpoint import step_dir, verify
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.runtime.driver import RankDriver, Save
from trainyard.parallel.runtime.local_world import spawn
from trainyard.parallel.spec import parse_spec

from bench.context import BenchContext
from bench.machine import busy_fraction
from bench.perf import paired_ratio, rotated
from bench.results import Row, ratio
from bench.service_job import BenchError

MODEL = {"n_layer": 6, "n_head": 5, "d_model": 320, "vocab_size": 256, "seq_len": 128}
SPEC: dict[str, Any] = {
    "name": "bench-checkpoint",
    "seed": 1234,
    "model": MODEL,  # 7.6M parameters: 87 MB of parameters and AdamW moments (12 bytes each)
    "data": {"kind": "synthetic"},
    "global_batch": 4,
    "steps": 1000,  # the learning-rate schedule's length only; the section runs far fewer
    "parallel": {"dp": 2},
    "checkpoint": {"keep": 2},
    "resources": {"gpus_per_worker": 0},
}
PARTS = ("sync", "async", "overlap", "plain")
ROUNDS = 8
WARMUP_STEPS = 2
STEPS_IN_FLIGHT = 4
RANK_TIMEOUT_S = 300
MB = 2**20

Record = dict[str, Any]  # one round of one rank: seconds per part, plus lists of step times


class _Rank:
    """One rank's trainer and step counter, and the timed parts of a round."""

    def __init__(self, plan: Plan, rank: int, port: int, root: Path):
        self.rank, self.root = rank, root
        self.driver = RankDriver(plan, rank, "127.0.0.1", port, torch.device("cpu"), timeout_s=RANK_TIMEOUT_S)
        self.step = 0

    def train(self, steps: int) -> list[float]:
        """`steps` training steps, each after a barrier; this rank's time inside each."""
        times = []
        for _ in range(steps):
            share = self.driver.microbatches(self.step)
            dist.barrier()
            times.append(self.driver.step(self.step, share)["compute_s"])
            self.step += 1
        return times

    def save(self, kind: str, background: bool) -> float:
        dist.barrier()
        return self.driver.save(Save(self.root / kind, {"bench": kind}, background), self.step)

    def finish(self) -> float:
        start = time.perf_counter()
        self.driver.trainer.finish_checkpoint()
        return time.perf_counter() - start

    def load(self, directory: Path, step: int, cold: bool) -> float:
        if cold:
            drop_page_cache(directory)
        dist.barrier()
        start = time.perf_counter()
        self.driver.load(directory, step)
        return time.perf_counter() - start

    def round(self, round_no: int) -> Record:
        record: Record = {}
        for part in rotated(PARTS, round_no):
            if part == "sync":
                record["sync_s"] = self.save("sync", background=False)
                record["sync_step"] = self.step
                record["verify_s"] = self._verify(step_dir(self.root / "sync", self.step))
            elif part == "async":
                record["async_block_s"] = self.save("async", background=True)
                record["async_finish_s"] = self.finish()
            elif part == "overlap":
                record["overlap_block_s"] = self.save("overlap", background=True)
                record["overlap_steps_s"] = self.train(STEPS_IN_FLIGHT)
                record["overlap_finish_s"] = self.finish()
            else:
                record["plain_steps_s"] = self.train(STEPS_IN_FLIGHT)
        directory = step_dir(self.root / "sync", record["sync_step"])
        for cache in rotated(("warm", "cold"), round_no):  # a cold load leaves the files in the page cache again
            record[f"load_{cache}_s"] = self.load(directory, record["sync_step"], cold=cache == "cold")
        record["bytes"] = dir_bytes(directory)
        return record

    def _verify(self, directory: Path) -> float | None:
        """Rank 0 re-hashes the checkpoint it just committed (the other rank waits)."""
        seconds = None
        if self.rank == 0:
            start = time.perf_counter()
            problem = verify(directory)
            seconds = time.perf_counter() - start
            assert problem is None, problem
        dist.barrier()
        return seconds


def _rank_main(rank: int, port: int, plan: Plan, root: str, out_dir: str, rounds: int) -> None:
    torch.set_num_threads(1)
    me = _Rank(plan, rank, port, Path(root))
    me.train(WARMUP_STEPS)
    for background in (False, True):  # first-use costs (DCP's imports, planner, writer thread) not measured
        me.save("warmup", background)
        me.finish()
    records = [me.round(r) for r in range(rounds)]
    torch.save(records, Path(out_dir) / f"checkpoint-rank{rank}.pt")
    me.driver.close()


def dir_bytes(directory: Path) -> int:
    """The checkpoint's size on disk as its files count it: the sum of the sizes of the files in it."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def drop_page_cache(directory: Path) -> None:
    """Ask the kernel to drop the files' pages from the page cache (clean pages only: they were fsynced), so
    the next read goes to the disk, or at least to whatever caches the VM's disk below this kernel."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def slower(records: list[list[Record]], key: str) -> list[float]:
    """Per round, the slower rank's seconds of `key` (ranks that did not time it are skipped)."""
    return [max(rank[r][key] for rank in records if rank[r][key] is not None) for r in range(len(records[0]))]


def slower_steps(records: list[list[Record]], key: str) -> list[list[float]]:
    """Per round, each step's time of the slower rank (a step ends when both ranks are done)."""
    return [[max(steps) for steps in zip(*(rank[r][key] for rank in records), strict=True)]
            for r in range(len(records[0]))]


def filesystem(path: Path) -> str:
    """`df -T`'s device, type and mount point of the filesystem holding path."""
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return parse_df(out)


def parse_df(out: str) -> str:
    lines = out.strip().splitlines()
    fields = lines[-1].split() if lines else []
    return f"{fields[1]} on {fields[0]} (mounted at {fields[-1]})" if len(fields) >= 7 else "unknown"


def run_section(ctx: BenchContext) -> list[Row]:
    rounds = ctx.rounds or ROUNDS
    plan = make_plan(parse_spec(SPEC))
    params = sum(p.numel() for p in full_model(plan.config.model, plan.config.seed).parameters())
    root = ctx.run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    fs = filesystem(root)
    ctx.log(f"checkpoint: GPT {_model_text()}, {params / 1e6:.1f}M parameters, dp=2 gloo; {rounds} rounds of "
            f"{', '.join(PARTS)} (rotating), then loads; writing under {root} ({fs})")
    busy = busy_fraction() or 0.0
    ctx.log(f"machine {100 * busy:.0f}% busy before the run (others' load; high means noisy timings)")
    start = time.perf_counter()
    spawn(_rank_main, plan.world_size, plan, str(root), str(ctx.run_dir), rounds)
    records = [torch.load(ctx.run_dir / f"checkpoint-rank{r}.pt") for r in range(plan.world_size)]
    ctx.log(f"ranks done in {time.perf_counter() - start:.0f} s")
    last = step_dir(root / "sync", records[0][-1]["sync_step"])
    files = {p.name: p.stat().st_size for p in sorted(last.iterdir())}
    (ctx.run_dir / "checkpoint.json").write_text(json.dumps({"records": records, "files": files}))
    shutil.rmtree(root)  # 7 checkpoints of 88 MB: scratch, not worth keeping under bench/.runs
    ctx.log(f"the last sync checkpoint's files: {_files_text(files)}")
    sizes = [rec["bytes"] for rank in records for rec in rank]
    if max(sizes) - min(sizes) > 4096:  # the manifest's text may differ by a few bytes (the step's digits)
        raise BenchError(f"checkpoint: the committed checkpoints differ in size: {sorted(set(sizes))}")
    return _rows(records, max(sizes), params, fs, busy, files)


def _rows(records: list[list[Record]], size: int, params: int, fs: str, busy: float,
          files: dict[str, int]) -> list[Row]:
    med = {key: statistics.median(slower(records, key)) for key in (
        "sync_s", "verify_s", "async_block_s", "async_finish_s", "overlap_block_s", "overlap_finish_s",
        "load_warm_s", "load_cold_s")}
    async_total = [b + f for b, f in zip(slower(records, "async_block_s"), slower(records, "async_finish_s"),
                                          strict=True)]
    overlap, plain = slower_steps(records, "overlap_steps_s"), slower_steps(records, "plain_steps_s")
    first_step = [steps[0] for steps in overlap]
    plain_step = [statistics.median(steps) for steps in plain]
    # The loop's time for STEPS_IN_FLIGHT steps and one checkpoint, each way (per round).
    with_async = [b + sum(steps) + f for b, steps, f in zip(
        slower(records, "overlap_block_s"), overlap, slower(records, "overlap_finish_s"), strict=True)]
    with_sync = [s + sum(steps) for s, steps in zip(slower(records, "sync_s"), plain, strict=True)]
    mb, n = size / MB, len(records[0])
    for key, value in med.items():
        print(f"  {key:<18} median {value:.4f} s")
    first = (f"GPT {_model_text()} ({params / 1e6:.1f}M params), dp=2 gloo, 1 thread per rank; checkpoint "
             f"{mb:.1f} MB ({params * 12 / MB:.1f} MB = 12 bytes per parameter: weights + AdamW moments); "
             f"{n} rounds, parts in rotating order, slower rank's time; {fs}; machine {100 * busy:.0f}% busy before")
    return [
        Row("checkpoint save, step loop blocked, async vs sync (median s)", med["async_block_s"], med["sync_s"],
            ratio(med["async_block_s"], med["sync_s"]), "s",
            f"async blocks while DCP stages (copies) the state; sync for the whole save + commit; {first}"),
        Row("checkpoint save, async staging + background write until committed vs sync (median s)",
            statistics.median(async_total), med["sync_s"], ratio(statistics.median(async_total), med["sync_s"]),
            "s", f"finish_checkpoint() right after the async save: {med['async_finish_s']:.4f} s (the write and "
                 "the commit, nothing else running)"),
        Row("checkpoint save throughput, sync (MB/s)", mb / med["sync_s"], None, None, "MB/s",
            f"{mb:.1f} MB / the median sync save; DCP fsyncs every file; includes the commit; files "
            f"{_files_text(files)}"),
        Row("checkpoint commit hashing: verify (SHA-256 of every file) vs sync save (median s)", med["verify_s"],
            med["sync_s"], ratio(med["verify_s"], med["sync_s"]), "s",
            f"rank 0 re-hashes the committed files as commit did (page cache warm): {mb / med['verify_s']:.0f} MB/s; "
            "ratio = the hashing's share of a sync save"),
        Row("checkpoint load throughput, page cache warm (MB/s)", mb / med["load_warm_s"], None, None, "MB/s",
            f"load_checkpoint on the same trainers, {med['load_warm_s']:.4f} s; the files as just written, in "
            "memory"),
        Row("checkpoint load throughput, page cache dropped (MB/s)", mb / med["load_cold_s"], None, None, "MB/s",
            f"{med['load_cold_s']:.4f} s; each file's pages dropped first (POSIX_FADV_DONTNEED); the VM's host may "
            "still cache the disk"),
        Row("step time, the first step after an async save vs a step with no save in flight (median s)",
            statistics.median(first_step), statistics.median(plain_step), paired_ratio(first_step, plain_step), "s",
            f"ratio: median of the {n} per-round ratios; steps 2-{STEPS_IN_FLIGHT} after it: "
            f"{statistics.median(t for steps in overlap for t in steps[1:]):.4f} s; finish_checkpoint after "
            f"{STEPS_IN_FLIGHT} steps waited {med['overlap_finish_s']:.4f} s more"),
        Row(f"{STEPS_IN_FLIGHT} steps + one checkpoint, async vs sync (median s)", statistics.median(with_async),
            statistics.median(with_sync), paired_ratio(with_async, with_sync), "s",
            f"async: save (blocked {med['overlap_block_s']:.4f} s) + {STEPS_IN_FLIGHT} steps + finish_checkpoint; "
            f"sync: save + {STEPS_IN_FLIGHT} steps with nothing in flight; ratio: median of the {n} per-round "
            "ratios"),
    ]


def _files_text(files: dict[str, int]) -> str:
    return ", ".join(f"{name} {size / MB:.2f} MB" for name, size in files.items())


def _model_text() -> str:
    return (f"{MODEL['n_layer']} layers, d_model {MODEL['d_model']}, seq_len {MODEL['seq_len']}, "
            f"vocab {MODEL['vocab_size']}")
