"""The host reads a training step makes (issue 48 item 7): one per step for the step's figures (loss, gradient norm,
MoE statistics, stacked), and in MoE blocks one per layer and micro-batch when dropless, none with a capacity; and
that the one read comes a step late (item 2): a rank's call for step N returns step N-1's figures, read once N's
work is queued, and a divergence is reported as the step it happened in. Also the other way: a step's copies of
host data to the device (its micro-batches, packed data's documents, a grouped MoE layer's offsets) never make the
host wait (`parallel.models.components.transfers`), which on a GPU a copy from pageable memory does.

A read is counted where, on a GPU, it would make the host wait for the device: `_local_scalar_dense` (`.item()`,
`float(t)`, `int(t)`), `is_nonzero` (`bool(t)`, `if t:`), `equal`, a `Tensor.tolist()` (which does not dispatch:
counted by wrapping the method while the step runs), and the ops whose output's size depends on the data
(`nonzero`, `masked_select`, `bincount`, `unique`, `repeat_interleave` without `output_size`). On CPU every tensor
counts as the device's but torch's optimizer step counters, which torch keeps on the host on every device (not
capturable): reading one is no wait for a GPU. The data is synthetic, so reading the step's samples (host data on
every device) makes no read here. One rank, one process, gloo at world size 1: a worker's `RankDriver` as is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from data_helpers import word_tokenizer
from torch.utils._python_dispatch import TorchDispatchMode
from trainyard.parallel.config import DataConfig, JobConfig, ModelConfig, MoEConfig, OptimizerConfig, ParallelConfig
from trainyard.parallel.data.prepare import prepare
from trainyard.parallel.data.sampler import step_microbatches
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.driver import RankDriver, Save
from trainyard.parallel.runtime.local_world import free_ports
from trainyard.parallel.runtime.step.step_stats import DivergedError

aten = torch.ops.aten
SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}
SIZE_FROM_DATA = {aten.nonzero.default, aten.masked_select.default, aten.bincount.default, aten._unique2.default,
                  aten.unique_consecutive.default, aten.unique_dim.default}
MICROBATCHES, LAYERS = 2, 2


class HostReads(TorchDispatchMode):
    """Counts the reads (module doc) made while it is entered, with where each was made; `host` tensors
    (by storage) are not the device's."""

    def __init__(self, host: set[int]):
        super().__init__()
        self.host = host
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_host = first is not None and first.untyped_storage().data_ptr() in self.host
        if (func in SCALAR_READS and not on_host) or func in SIZE_FROM_DATA or (
                func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            self.record(str(func))
        return func(*args, **kwargs)

    def record(self, what: str) -> None:
        where = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in traceback.extract_stack()[:-2]]
        self.reads.append(f"{what} at {' < '.join(reversed(where[-3:]))}")


@contextmanager
def counting(host: set[int]) -> Iterator[HostReads]:
    mode = HostReads(host)
    tolist = torch.Tensor.tolist

    def counted_tolist(self: torch.Tensor):
        if self.untyped_storage().data_ptr() not in host:
            mode.record("Tensor.tolist")
        return tolist(self)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
    try:
        with mode:
            yield mode
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]


def job(moe: MoEConfig | None = None, kind: str = "adamw") -> JobConfig:
    model = ModelConfig(n_layer=LAYERS, n_head=2, d_model=32, vocab_size=128, seq_len=16, moe=moe)
    return JobConfig(name="reads", model=model, steps=2, data=DataConfig(kind="synthetic"), global_batch=4,
                     parallel=ParallelConfig(microbatches=MICROBATCHES), optimizer=OptimizerConfig(kind=kind))


@pytest.fixture(scope="module")
def driver() -> Iterator[RankDriver]:
    """One rank's process group for every job here (each gets its own trainer: `trainer_for`)."""
    driver = RankDriver(make_plan(job()), 0, "127.0.0.1", free_ports(1)[0], torch.device("cpu"), 60)
    yield driver
    driver.close()


def step_reads(driver: RankDriver, cfg: JobConfig) -> tuple[list[str], list[str]]:
    """The reads of one step of a tiny one-rank job (its optimizer state created first, as its first step would):
    those made while its work is queued (`queue_step`), and those of reading its figures (`read_step`)."""
    trainer = driver.trainer_for(make_plan(cfg))
    ids = [driver.microbatches(step) for step in range(2)]
    trainer.optimizer.init_state()
    counters = {s["step"].untyped_storage().data_ptr() for o in trainer.optimizer.optimizers
                for s in o.state.values() if "step" in s}
    with counting(counters) as queueing:
        queued = trainer.queue_step(1, ids[1])
    with counting(counters) as reading:
        stats = trainer.read_step(queued)
    assert stats.loss is not None and stats.grad_norm > 0  # the step's figures reached the host
    return queueing.reads, reading.reads


ONE_READ = "Tensor.tolist at step_figures.py"


@pytest.mark.parametrize("kind", ["adamw", "adafactor"])
def test_a_dense_step_reads_the_device_once_when_its_figures_are_read(driver, kind):
    queueing, reading = step_reads(driver, job(kind=kind))
    assert queueing == [] and len(reading) == 1 and reading[0].startswith(ONE_READ), (queueing, reading)


def test_a_dropless_moe_step_reads_once_per_layer_and_microbatch(driver):
    queueing, reading = step_reads(driver, job(MoEConfig(experts=4, top_k=2, every=1, capacity_factor=None)))
    assert len(queueing) == LAYERS * MICROBATCHES and all("moe.py" in r for r in queueing), queueing
    assert len(reading) == 1 and reading[0].startswith(ONE_READ), reading


def test_an_moe_step_with_a_capacity_reads_nothing_in_dispatch(driver):
    queueing, reading = step_reads(driver, job(MoEConfig(experts=4, top_k=2, every=1, capacity_factor=1.0)))
    assert queueing == [] and len(reading) == 1 and reading[0].startswith(ONE_READ), (queueing, reading)


@pytest.fixture
def late(driver: RankDriver) -> Iterator[RankDriver]:
    """The module's driver with a trainer of its own plan, fresh (the others' steps leave it untouched)."""
    own = driver.trainer
    driver.trainer = driver.trainer_for(driver.plan)
    yield driver
    driver.flush()
    driver.trainer = own


def test_a_step_call_returns_the_previous_steps_figures_and_the_flush_the_last(late):
    reference = late.trainer_for(late.plan)  # the same start, its figures read at once
    expected = [reference.train_step(step, late.microbatches(step)).to_dict() for step in range(2)]
    assert late.queue_step(0) == []  # step 0 queued; nothing finished before it
    first = late.queue_step(1)  # step 1 queued; then step 0's figures read
    last = late.flush()
    assert [s["step"] for s in first] == [0] and [s["step"] for s in last] == [1] and late.flush() == []
    for got, want in zip(first + last, expected, strict=True):  # bitwise: only the read moved
        assert (got["loss"], got["grad_norm"], got["lr"]) == (want["loss"], want["grad_norm"], want["lr"])


def test_a_divergence_is_reported_as_its_own_step_one_step_late(late):
    late.queue_step(0)
    with torch.no_grad():  # step 1 then trains on NaN: its loss and gradient norm are not finite
        next(late.trainer.chunks[0].parameters()).fill_(float("nan"))
    (figures,) = late.queue_step(1)
    assert figures["step"] == 0 and math.isfinite(figures["loss"])  # step 0's, computed before the NaN
    with pytest.raises(DivergedError, match=r"^step 1: training diverged: loss nan"):
        late.queue_step(2)  # step 2 queued, then step 1's figures read
    assert late.trainer.steps_done is None  # no recovery takes this state


def test_the_counter_sees_each_kind_of_read():
    # What the budget would miss if the counter were blind: each kind of read, on a CPU tensor, counted once.
    t = torch.tensor([1.0, 0.0, 2.0])
    with counting(set()) as reads:
        float(t[0])
        bool(t[1])
        t.tolist()
        t.nonzero()
        torch.equal(t, t)
        torch.tensor([1, 2]).repeat_interleave(torch.tensor([1, 1]))
        torch.tensor([1, 2]).repeat_interleave(torch.tensor([1, 1]), output_size=2)  # sized: no read
    assert len(reads.reads) == 6, reads.reads


def test_a_step_that_saves_reads_its_own_figures_first_and_no_checkpoint_holds_a_diverged_step(late, tmp_path):
    save = Save(tmp_path, {})
    (saved,) = late.queue_step(0, save=save)  # step 0's figures in its own call: read and checked, then saved
    assert saved["step"] == 0 and "checkpoint_blocked_s" in saved and checkpoint.committed_steps(tmp_path) == [1]
    with torch.no_grad():
        next(late.trainer.chunks[0].parameters()).fill_(float("nan"))
    with pytest.raises(DivergedError, match=r"^step 1: training diverged"):
        late.queue_step(1, save=save)
    assert checkpoint.committed_steps(tmp_path) == [1]  # the state after the diverged step 1 was not saved


@contextmanager
def copies_to_the_device() -> Iterator[tuple[list[str], list[str]]]:
    """The copies of host data to a device that the project's code (not torch's) makes while it is entered: those
    that would make the host wait on a GPU, `Tensor.to(device)` without `non_blocking=True` and `torch.tensor(data,
    device=...)` (on CUDA a copy from pageable memory, then a synchronization of the stream), and the others. On the
    CPU each is a no-op, so the call is what is counted, with where it was made."""
    found: list[str] = []
    fine: list[str] = []
    to, tensor = torch.Tensor.to, torch.tensor
    parallel = str(Path(checkpoint.__file__).parents[1])  # the product's parallel/ folder, as its code names it

    def ours() -> bool:
        return sys._getframe(2).f_code.co_filename.startswith(parallel)

    def where() -> str:
        frames = traceback.extract_stack()[:-2]
        return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames[-3:]))

    def checked_to(self: torch.Tensor, *args, **kwargs):
        device = kwargs.get("device", next((a for a in args if isinstance(a, torch.device | str | torch.Tensor)), None))
        non_blocking = kwargs.get("non_blocking", any(a is True for a in args))
        if device is not None and ours():
            (fine if non_blocking else found).append(f"Tensor.to({device}) at {where()}")
        return to(self, *args, **kwargs)

    def checked_tensor(*args, **kwargs):
        if kwargs.get("device") is not None and ours():
            found.append(f"torch.tensor(device={kwargs['device']}) at {where()}")
        return tensor(*args, **kwargs)

    torch.Tensor.to, torch.tensor = checked_to, checked_tensor  # type: ignore[method-assign,assignment]
    try:
        yield found, fine
    finally:
        torch.Tensor.to, torch.tensor = to, tensor  # type: ignore[method-assign,assignment]


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    """A prepared directory of whole examples (word tokens, `w0 ... w126`, EOS 127)."""
    root = tmp_path_factory.mktemp("examples")
    lines = [" ".join(f"w{(7 * i + j) % 127}" for j in range(3 + 5 * i % 23)) for i in range(40)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    prepare([root / "docs.jsonl"], root / "prepared", word_tokenizer(root / "tok", 128), progress=False)
    return root / "prepared"


@pytest.mark.parametrize("variant", ["dense", "dropless moe, grouped", "packed"])
def test_a_step_copies_its_host_data_to_the_device_without_waiting(driver, examples, variant):
    # A step's inputs and targets, packed data's documents and a grouped MoE layer's offsets each went over with a
    # blocking copy: on CUDA a synchronization of the stream, the host waiting for the previous step's work
    cfg = {"dense": job(), "dropless moe, grouped": job(MoEConfig(experts=4, top_k=2, every=1)),
           "packed": dataclasses.replace(job(), data=DataConfig(kind="tokens", path=str(examples), packing=True))
           }[variant]
    plan = make_plan(cfg)
    trainer = driver.trainer_for(plan)
    for _, layer in trainer.moe_layers:
        layer.grouped_mm = True  # the experts as one grouped matmul (CUDA's path on Hopper; torch runs it here too)
    ids = [step_microbatches(plan, 0, step, trainer.dataset.num_samples) for step in range(2)]
    trainer.read_step(trainer.queue_step(0, ids[0]))
    with copies_to_the_device() as (blocking, non_blocking):
        stats = trainer.read_step(trainer.queue_step(1, ids[1]))
    assert math.isfinite(stats.loss)
    assert blocking == [] and non_blocking, (blocking, non_blocking)  # (the counter sees the step's copies)
