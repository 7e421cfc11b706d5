"""`python -m bench.gpu_smoke [--device cuda] [--only NAME ...] [--out FILE]`: one rank of each kind of job the
project has, on one device with torch alone (NCCL on CUDA, gloo on CPU); it also runs with `--device cpu`.

Each training variant trains 4 steps straight, saving a DCP checkpoint after the 3rd, then a fresh rank loads it
and runs the 4th step: the resumed loss equals the straight one, and so do the parameters after it (bit for bit, or for
adamw8bit and adafactor, whose checkpoint holds their state in another form, within its documented round trip:
`ROUND_TRIP`). Before its first step the straight run's rank, built on the meta device and materialized on the
device, holds bit for bit the parameters and buffers of the same stage built whole on the CPU from the seed. The
checkpoint is exported: trainyard's file and a Hugging Face directory (a LoRA job: the merged model, and its
adapters as a PEFT directory). On CUDA each variant's losses are compared with the same run on the CPU (fp32:
within 1e-3 relative; TF32 off) or with its fp32 twin (bf16: within 5e-2, `BF16_TWIN`).

The variants: gpt2 and llama (grouped-query attention) in fp32 and bf16; selective and full recompute; optimizer
and activation offload; adafactor; compile; MoE dropless in fp32 (the experts one after another) and in bf16 (on
a Hopper GPU the experts as `torch._grouped_mm`, whose calls are counted), MoE with a capacity and tied
embeddings; LoRA on every llama projection in fp32 and bf16 (the checkpoint holds the adapters alone, the export
the base the seed built, untouched); whole examples of a prepared directory (written here with `trainyard
prepare`'s own shard writer and manifest, no tokenizer run), packed several to a row (the attention under a
document mask: the GPU attention path; llama fp32 and bf16, gpt2 with full recompute) and unpacked; adamw8bit
(torchao's AdamW8bit: on CUDA its compiled step, whose graphs are counted, on the CPU the same step eagerly; its
moments 8-bit) and adamw8bit offloaded (the eager host step).

"host reads: VARIANT" (CUDA only): the variant at 2 micro-batches under `torch.cuda.set_sync_debug_mode("warn")`,
a warm-up step, then each of 4 driver calls (a step queued, the previous step's figures read:
`RankDriver.queue_step`) and the last flush against tests/unit/test_host_reads.py's budget: the figures' one read
(`Figures.read`, which the debug mode does not flag), and in dropless MoE blocks one per MoE layer and
micro-batch. A call over it fails, naming where each synchronizing operation came from.

Prints a line a variant: `ok` with what it checked, `FAIL` with the error, or `skip` with why (the host reads off
CUDA, adamw8bit without torchao); then "N of M variants passed on DEVICE" (M: those not skipped), and exits 1 if
any failed: what broke on the device and not on the CPU is a defect. `--out FILE` writes the JSON summary
{VARIANT: {ok (null when skipped, with `skipped`), losses, vs (the comparison on CUDA), error, seconds, reads (a
host-read check's counts)}, device, torch}."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from trainyard.parallel.config import (
    DataConfig,
    JobConfig,
    LoraConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    ResourcesConfig,
)
from trainyard.parallel.data.prepare import _ShardWriter
from trainyard.parallel.data.token_dir import DOCUMENT_ENDS, MANIFEST, TOKENIZER, Manifest, dtype_for, file_sha256
from trainyard.parallel.io.checkpoint import step_dir
from trainyard.parallel.io.export import export_model
from trainyard.parallel.io.hf_checkpoint import write_hf_dir
from trainyard.parallel.io.peft_adapter import write_peft_dir
from trainyard.parallel.models import family_of
from trainyard.parallel.models.components.lora import apply_lora, is_adapter, merged
from trainyard.parallel.models.components.moe import capacity
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.runtime.driver import RankDriver, Save
from trainyard.parallel.runtime.local_world import free_ports
from trainyard.parallel.runtime.materialize import local_slices
from trainyard.parallel.runtime.step.step_figures import Figures
from trainyard.parallel.runtime.tp.local_parts import local_part

STEPS = 4
GPT2 = ModelConfig(n_layer=2, n_head=4, d_model=128, vocab_size=512, seq_len=128)
LLAMA = ModelConfig(family="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=128, vocab_size=512, seq_len=128)
MOE = MoEConfig(experts=4, top_k=2, every=1)  # dropless; llama's experts 512 wide: grouped_mm's widths on Hopper
LORA = LoraConfig(rank=8, alpha=16.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
DOCUMENTS = "{documents}"
"""A variant's data path that stands for the prepared directory of whole examples this run writes (`documents`)."""
PACKED = DataConfig(kind="tokens", path=DOCUMENTS, packing=True)
UNPACKED = DataConfig(kind="tokens", path=DOCUMENTS, packing=False)
VARIANTS: dict[str, dict] = {
    "gpt2 fp32": {"model": GPT2},
    "gpt2 bf16 selective recompute": {"model": GPT2, "precision": "bf16", "activation_checkpointing": "selective"},
    "gpt2 full recompute, optimizer and activation offload": {
        "model": GPT2, "activation_checkpointing": "full", "activation_offload": True,
        "optimizer": OptimizerConfig(offload=True)},
    "gpt2 adafactor": {"model": GPT2, "optimizer": OptimizerConfig(kind="adafactor", lr=0.05)},
    "gpt2 compile": {"model": GPT2, "compile": True},
    "llama gqa fp32": {"model": LLAMA},
    "llama gqa bf16": {"model": LLAMA, "precision": "bf16"},
    "llama moe (ep 1) fp32": {"model": dataclasses.replace(LLAMA, moe=MOE)},
    "llama moe grouped bf16": {"model": dataclasses.replace(LLAMA, moe=MOE), "precision": "bf16"},
    "llama tied, moe with capacity": {"model": dataclasses.replace(LLAMA, tie_embeddings=True, moe=MoEConfig(
        experts=4, top_k=2, every=1, capacity_factor=1.0))},
    "llama lora fp32": {"model": dataclasses.replace(LLAMA, lora=LORA)},
    "llama lora bf16": {"model": dataclasses.replace(LLAMA, lora=LORA), "precision": "bf16"},
    "llama packed fp32": {"model": LLAMA, "data": PACKED},
    "llama packed bf16": {"model": LLAMA, "data": PACKED, "precision": "bf16"},
    "gpt2 packed, full recompute": {"model": GPT2, "data": PACKED, "activation_checkpointing": "full"},
    "llama examples unpacked": {"model": LLAMA, "data": UNPACKED},
    "gpt2 adamw8bit": {"model": GPT2, "optimizer": OptimizerConfig(kind="adamw8bit")},
    "gpt2 adamw8bit offload": {"model": GPT2, "optimizer": OptimizerConfig(kind="adamw8bit", offload=True)},
}
BF16_TWIN = {"gpt2 bf16 selective recompute": "gpt2 fp32", "llama gqa bf16": "llama gqa fp32",
             "llama moe grouped bf16": "llama moe (ep 1) fp32", "llama lora bf16": "llama lora fp32",
             "llama packed bf16": "llama packed fp32"}
HOST_READS = {f"host reads: {name}": name for name in (
    "llama gqa fp32", "llama moe (ep 1) fp32", "llama moe grouped bf16", "llama tied, moe with capacity",
    "llama packed fp32")}
"""The host-read checks (CUDA only), each on the variant it names."""
READ_CALLS = 4
"""Driver calls counted per host-read check, after the warm-up step (and the flush after them)."""
SYNC_WARNING = "synchronizing CUDA operation"
ROUND_TRIP = {"adamw8bit": 1e-3, "adafactor": 1e-6}
"""The parameters after a resumed step may differ from the straight run's by this much of each tensor's largest
value where a checkpoint holds the optimizer's state in another form (`parallel.optim.states`): adamw8bit's moments
quantized again (1.2e-4 measured on the CPU), adafactor's second moments factored again (8e-8: rounding)."""


def config(name: str, device: torch.device, documents: Path | None) -> JobConfig:
    variant = dict(VARIANTS[name])
    data = variant.pop("data", DataConfig(kind="synthetic"))
    if data.path == DOCUMENTS:
        assert documents is not None, f"{name} trains on whole examples: give it the documents' directory"
        data = dataclasses.replace(data, path=str(documents))
    return JobConfig(name="gpu-smoke", steps=STEPS, data=data, global_batch=4, parallel=ParallelConfig(), seed=7,
                     resources=ResourcesConfig(gpus_per_worker=1 if device.type == "cuda" else 0), **variant)


def write_documents(out: Path, vocab_size: int, count: int = 120, seed: int = 0) -> Path:
    """A `trainyard prepare` directory (`parallel.data.token_dir`) of `count` documents of seeded random token ids,
    1 to 300 long (some longer than a sequence: cut into pieces) and each followed by EOS (the last id), written
    with prepare's own shard writer (several shards: the stream crosses them) and manifest, without a tokenizer to
    run (the tokenizer.json beside them is a word-level one naming the ids, `w0 w1 ...`, which training never reads)."""
    rng = np.random.default_rng(seed)
    eos, dtype = vocab_size - 1, dtype_for(vocab_size)
    out.mkdir(parents=True)
    writer = _ShardWriter(out, chat=False, shard_tokens=4096)
    ends, tokens = [], 0
    for _ in range(count):
        ids = np.append(rng.integers(0, eos, int(rng.integers(1, 301))), eos).astype(dtype)
        writer.write(ids, None)
        tokens += len(ids)
        ends.append(tokens)
    shards = writer.close()
    (out / DOCUMENT_ENDS).write_bytes(np.asarray(ends, dtype="<u8").tobytes())
    vocab = {f"w{i}": i for i in range(eos)} | {"<eos>": eos}
    (out / TOKENIZER).write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<eos>"}}))
    options = {"field": "text", "column": "text", "chat": False, "eos": "<eos>", "shard_tokens": 4096}
    manifest = Manifest(
        vocab_size=vocab_size, eos_id=eos, dtype=dtype, documents=count, tokens=tokens, counted_tokens=None,
        shards=shards, tokenizer={"file": TOKENIZER, "sha256": file_sha256(out / TOKENIZER), "config": None,
                                  "eos_token": "<eos>"},
        fingerprint=hashlib.sha256(json.dumps([seed, count, vocab_size]).encode()).hexdigest(), inputs=[],
        options=options, document_ends={"file": DOCUMENT_ENDS, "sha256": file_sha256(out / DOCUMENT_ENDS)})
    (out / MANIFEST).write_text(manifest.to_json())
    return out


@contextlib.contextmanager
def rank(plan: Plan, device: torch.device) -> Iterator[RankDriver]:
    """One rank of `plan` at world size 1, closed however its use ends (a failed variant leaves no process group
    behind for the next)."""
    driver = RankDriver(plan, 0, "127.0.0.1", free_ports(1)[0], device, 300.0)
    try:
        yield driver
    finally:
        driver.close()


def construction_mismatches(driver: RankDriver) -> list[str]:
    """What of the rank's chunks, built on the meta device and materialized on its device, is not bitwise the
    same stage built whole on the CPU from the seed (LoRA's adapters applied as training applies them): the names
    of the parameters and buffers that differ, and "tied" where the head stopped being the embedding's tensor."""
    plan, bad = driver.plan, []
    cfg = plan.config
    for chunk in driver.trainer.chunks:
        whole = family_of(cfg.model).build_stage(cfg.model, [int(i) for i in chunk.blocks], first=chunk.first,
                                                 last=chunk.last, seed=cfg.seed, experts=plan.experts_of(driver.rank))
        if cfg.model.lora is not None:
            whole = apply_lora(whole, seed=cfg.seed)
        expected = dict(whole.named_parameters()) | dict(whole.named_buffers())
        for name, p in [*chunk.named_parameters(), *chunk.named_buffers()]:
            if name not in expected or not torch.equal(local_part(p).detach().cpu(),
                                                        expected[name].detach()[local_slices(p)]):
                bad.append(name)
        if chunk.first and chunk.last and cfg.model.tie_embeddings and chunk.lm_head.weight is not chunk.wte.weight:
            bad.append("tied")
    return bad


def parameters(driver: RankDriver) -> dict[str, torch.Tensor]:
    """The rank's parameters on the CPU, once an offloaded optimizer's last (overlapped) step has reached them."""
    driver.trainer.optimizer.settle()
    return {f"{c}.{name}": local_part(p).detach().cpu().clone() for c, chunk in enumerate(driver.trainer.chunks)
            for name, p in chunk.named_parameters()}


def quantized_states(driver: RankDriver) -> int:
    """How many of the rank's optimizer state tensors are 8-bit (torchao's OptimState8bit)."""
    return sum(type(t).__name__ == "OptimState8bit" for o in driver.trainer.optimizer.optimizers
               for state in o.state.values() for t in state.values())


@contextlib.contextmanager
def counting_grouped_mm() -> Iterator[list[int]]:
    """The `torch._grouped_mm` calls made while it is entered (`parallel.models.components.grouped` calls it through
    `torch`)."""
    calls, original = [0], getattr(torch, "_grouped_mm", None)
    if original is None:
        yield calls
        return

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return original(*args, **kwargs)

    torch._grouped_mm = counted
    try:
        yield calls
    finally:
        torch._grouped_mm = original


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def grouped_expected(cfg: JobConfig, device: torch.device) -> str | None:
    """Why the variant's experts should run as grouped matmuls on `device` (None: they loop), as
    `parallel.models.components.grouped.use_grouped_mm` decides."""
    if cfg.model.moe is None or cfg.precision != "bf16" or device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return None
    widths = (cfg.model.d_model, family_of(cfg.model).ffn_hidden(cfg.model))
    if torch.cuda.get_device_capability(device) < (9, 0) or any(w % 8 for w in widths):
        return None
    return f"bf16, widths {widths}, cc {torch.cuda.get_device_capability(device)}"


def run(name: str, device: torch.device, where: Path, documents: Path | None) -> tuple[list[float], list[str]]:
    """The variant's 4 losses and what else was checked, after checking the construction, that a resumed 4th step
    equals the straight one, and exporting."""
    plan = make_plan(config(name, device, documents))
    cfg, notes = plan.config, []

    with rank(plan, device) as driver:
        mismatches = construction_mismatches(driver)
        assert not mismatches, f"materialized on {device} != built whole on the CPU: {mismatches}"
        notes.append("construction equal")
        graphs = compiled_graphs()
        with counting_grouped_mm() as grouped:  # a checkpoint after step 3 of 4 (saving changes nothing of the run)
            stats = driver.run(range(STEPS), save_after=(STEPS - 1,), save=Save(where / "ckpt", {"job": name}))
        straight, final = [s["loss"] for s in stats], parameters(driver)
        if (why := grouped_expected(cfg, device)) is not None:
            assert grouped[0] > 0, f"the experts never ran as torch._grouped_mm ({why})"
            notes.append(f"grouped_mm x{grouped[0]}")
        elif cfg.model.moe is not None and cfg.precision == "bf16":
            notes.append("experts looped (no grouped_mm here)")
        if cfg.optimizer.kind == "adamw8bit":
            quantized = quantized_states(driver)
            assert quantized > 0, "no optimizer state is 8-bit"
            notes.append(f"{quantized} states 8-bit")
            if device.type == "cuda" and not cfg.optimizer.offload:  # torchao compiles its step on the device
                assert compiled_graphs() > graphs, "adamw8bit's step compiled nothing on CUDA"
                notes.append(f"step compiled ({compiled_graphs() - graphs} graphs)")

    checkpoint = step_dir(where / "ckpt", STEPS - 1)
    with rank(plan, device) as driver:
        driver.load(checkpoint, STEPS - 1)
        resumed = driver.step(STEPS - 1)["loss"]
        after = parameters(driver)
    assert resumed == straight[-1], f"resumed step {STEPS - 1}: loss {resumed} != {straight[-1]}"
    # The step after the load, from the checkpoint's optimizer state: bitwise where that is the optimizer's own,
    # else within its documented round trip (`parallel.optim.states`)
    tolerance = ROUND_TRIP.get(cfg.optimizer.kind, 0.0)
    worst = max(float((after[n] - p).abs().max() / p.abs().max().clamp(min=1e-30)) for n, p in final.items())
    assert worst <= tolerance, f"after the resumed step {STEPS - 1} the parameters differ from the straight run's " \
                               f"by {worst:.1e} of their largest value (at most {tolerance:.0e})"
    if tolerance:
        notes.append(f"state round trip {worst:.0e}")

    exported = export_model(cfg, checkpoint, STEPS - 1, where / "model.safetensors")
    state = load_file(str(exported))
    if cfg.model.lora is None:
        write_hf_dir(where / "hf", cfg.model, state)  # export_hf's work (it reads the file's config with pydantic,
        # which a device image may lack)
    else:
        notes += lora_checks(cfg, checkpoint, state, final, where)
    assert all(math.isfinite(x) for x in straight), straight
    return straight, notes


def lora_checks(cfg: JobConfig, checkpoint: Path, state: dict[str, torch.Tensor], trained: dict[str, torch.Tensor],
                where: Path) -> list[str]:
    """A LoRA job's base stays the seed's through training (frozen: `trained`, the rank's parameters after its
    steps) and its adapters move; its checkpoint holds the adapters alone; the export (`state`) has both, and
    is written as export_hf and export_peft write it: the merged model, the adapters."""
    assert cfg.model.lora is not None
    base = full_model(dataclasses.replace(cfg.model, lora=None), cfg.seed).state_dict()
    trained = {name.split(".", 1)[1]: t for name, t in trained.items()}  # one chunk at world size 1
    changed = [n for n, t in base.items() if n in trained and not torch.equal(trained[n], t)]
    assert not changed, f"training changed frozen base weights: {changed}"
    b = [n for n in trained if n.endswith("lora_B.weight")]
    assert b and all(trained[n].abs().sum() > 0 for n in b), "an adapter's B is still zero after training"
    stored = [k.removeprefix("model.") for k in dcp.FileSystemReader(str(checkpoint)).read_metadata()
              .state_dict_metadata if k.startswith("model.")]
    assert stored and all(is_adapter(k) for k in stored), f"the checkpoint holds base weights: {stored}"
    assert all(torch.equal(state[n], t) for n, t in base.items()), "the export's base is not the seed's"
    write_hf_dir(where / "hf", dataclasses.replace(cfg.model, lora=None), merged(state, cfg.model.lora))
    write_peft_dir(where / "peft", cfg.model, state)
    return ["base frozen, adapters trained", f"checkpoint holds {len(stored)} adapters alone",
            "merged and PEFT exports"]


@contextlib.contextmanager
def recording_syncs() -> Iterator[dict[str, list[str]]]:
    """What needed the host to wait for the device while it is entered (CUDA): each synchronizing operation
    `torch.cuda.set_sync_debug_mode("warn")` reports, as where it came from ("syncs"), and each read of a step's
    figures (`Figures.read`: an event wait and a read of pinned memory, which the debug mode does not flag)."""
    found: dict[str, list[str]] = {"syncs": [], "figures": []}

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # warnings.showwarning's
        if SYNC_WARNING in str(message):
            found["syncs"].append(_site())

    read = Figures.read

    def counted_read(self: Figures) -> Any:
        found["figures"].append(_site())
        return read(self)

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        Figures.read = counted_read  # type: ignore[method-assign]
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            Figures.read = read  # type: ignore[method-assign]


def _site() -> str:
    """Where the current call came from in the project (the innermost frames of bench/ and trainyard's folders)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename and "warnings" not in f.filename]
    return " < ".join(f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


def host_reads(name: str, device: torch.device, documents: Path | None) -> tuple[dict, list[str]]:
    """The variant's steady-state driver calls under the sync debug mode, each against its budget (module doc)."""
    base = config(HOST_READS[name], device, documents)
    microbatches = 2
    cfg = dataclasses.replace(base, steps=READ_CALLS + 1, parallel=ParallelConfig(microbatches=microbatches))
    dropless = len(cfg.model.moe_blocks) if cfg.model.moe is not None and capacity(cfg.model) is None else 0
    budget = 1 + dropless * microbatches  # the previous step's figures, and each dropless MoE layer's counts
    with rank(make_plan(cfg), device) as driver:
        driver.queue_step(0)  # warm-up: first allocations, optimizer state
        calls = []
        for step in range(1, READ_CALLS + 1):
            with recording_syncs() as found:
                driver.queue_step(step)
            calls.append(found)
        with recording_syncs() as found:
            driver.flush()
    counts = [len(c["syncs"]) + len(c["figures"]) for c in calls]
    over = [(step, c) for step, c in enumerate(calls, 1) if len(c["syncs"]) + len(c["figures"]) > budget]
    detail = {"budget": budget, "per_call": counts, "flush": len(found["syncs"]) + len(found["figures"]),
              "sites": sorted({s for c in [*calls, found] for s in c["syncs"]})}
    if over or detail["flush"] > 1:
        lines = [f"call {step}: {len(c['syncs'])} syncs + {len(c['figures'])} figure reads > {budget}:\n      "
                 + "\n      ".join(c["syncs"]) for step, c in over]
        if detail["flush"] > 1:
            lines.append(f"flush: {detail['flush']} > 1:\n      " + "\n      ".join(found["syncs"]))
        raise AssertionError("over the host-read budget\n    " + "\n    ".join(lines))
    return detail, [f"reads per call {counts} (budget {budget}: figures 1 + dropless MoE "
                    f"{dropless} layers x {microbatches} micro-batches)",
                    f"flagged syncs per call {[len(c['syncs']) for c in calls]}"]


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _skip_reason(name: str, device: torch.device) -> str | None:
    if name in HOST_READS and device.type != "cuda":
        return f"set_sync_debug_mode is CUDA only (device {device})"
    variant = VARIANTS.get(HOST_READS.get(name, name), {})
    if variant.get("optimizer", OptimizerConfig()).kind == "adamw8bit" and importlib.util.find_spec("torchao") is None:
        return "adamw8bit needs torchao, which is not installed here"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", nargs="*", help="variant names (default: all)")
    p.add_argument("--out", type=Path, help="write a JSON summary of every variant here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    names = args.only or [*VARIANTS, *HOST_READS]
    unknown = [n for n in names if n not in VARIANTS and n not in HOST_READS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {[*VARIANTS, *HOST_READS]}")
    results: dict[str, list[float]] = {}
    summary: dict[str, Any] = {}
    failed = skipped = 0
    with tempfile.TemporaryDirectory() as work:
        documents = write_documents(Path(work) / "documents", LLAMA.vocab_size)

        def losses_of(variant: str, on: torch.device) -> list[float]:
            with tempfile.TemporaryDirectory() as d:
                return run(variant, on, Path(d), documents)[0]

        for name in names:
            entry: dict[str, Any] = {"ok": None, "losses": [], "vs": None, "error": None}
            summary[name] = entry
            if (why := _skip_reason(name, device)) is not None:
                skipped += 1
                entry["skipped"] = why
                print(f"skip  {name}: {why}", flush=True)
                continue
            start = time.perf_counter()
            try:
                if name in HOST_READS:
                    entry["reads"], notes = host_reads(name, device, documents)
                    line = f"ok    {name}: " + "; ".join(notes)
                else:
                    with tempfile.TemporaryDirectory() as d:
                        losses, notes = run(name, device, Path(d), documents)
                    results[name] = entry["losses"] = losses
                    line = f"ok    {name}: losses {[round(x, 5) for x in losses]}; resume equal; exported; " + \
                        "; ".join(notes)
                    if device.type == "cuda" and name in BF16_TWIN:
                        twin = BF16_TWIN[name]
                        if twin not in results:
                            results[twin] = losses_of(twin, device)
                        worst = _relative(losses, results[twin])
                        entry["vs"] = {"against": twin, "worst_relative_difference": worst}
                        assert worst < 5e-2, f"bf16 vs fp32: {worst:.2e}"
                        line += f"; vs fp32 {worst:.1e}"
                    elif device.type == "cuda":
                        cpu = losses_of(name, torch.device("cpu"))
                        worst = _relative(losses, cpu)
                        entry["vs"] = {"against": "cpu", "worst_relative_difference": worst, "cpu_losses": cpu}
                        assert worst < 1e-3, f"cuda vs cpu: {worst:.2e} ({losses} vs {cpu})"
                        line += f"; vs cpu {worst:.1e}"
                entry["ok"] = True
                print(line, flush=True)
            except Exception as e:  # noqa: BLE001 - a smoke run reports every variant
                failed += 1
                entry["ok"], entry["error"] = False, f"{type(e).__name__}: {e}"
                print(f"FAIL  {name}:\n{traceback.format_exc()}", flush=True)
            entry["seconds"] = round(time.perf_counter() - start, 2)
    ran = len(names) - skipped
    print(f"{ran - failed} of {ran} variants passed on {device}" + (f"; {skipped} skipped" if skipped else ""))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**summary, "device": _device_name(device), "torch": torch.__version__},
                                       indent=2) + "\n")
    return 1 if failed else 0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}, cc {torch.cuda.get_device_capability(device)})"
    return str(device)


if __name__ == "__main__":
    sys.exit(main())
