"""Section "step": trainyard's one-rank step against a plain torch loop of the same model and data, and the peak
bytes of the loss computation, fused (trainyard's) against torch's cross-entropy.

Run: `python -m bench.run --only step` (about a minute on 2 cores); torch and gloo in this process, no Ray.

The sides are `bench.gpu`'s, on the CPU (`python -m bench.gpu --small --device cpu` is the same comparison with
its own report): trainyard's `RankTrainer.queue_step` through a `RankDriver` at world size 1, each step's figures
read one step late and its samples read and copied as a worker does, against the textbook loop (the same
`full_model`, init, samples, AdamW foreach with the same groups, schedule and clipping, its batches already in
place), steps interleaved in rotating rounds so both see the same machine. fp32, one torch thread.

The model (`bench.gpu.SMALL`: GPT, 4 blocks, d_model 256, 4 heads, vocab 8192, 8 x 128 tokens a step) is the
smallest whose step is matmul-bound on one CPU thread, as GPT-2 medium's is on a GPU: a few hundred ms a step,
so the trainer's fixed cost per step (its Python: buckets, the pipeline executor, the one host read) weighs what
it would on a real job, not what it weighs on a toy where it is most of the step. Its vocabulary is 32 x d_model
(GPT-2's is 49 x), so the loss's share of the step is of the same order as there. Neither side is favoured: same
work, same data, same optimizer; the plain loop's data is on the device already, which only helps it.

The loss's peak: one micro-batch's hidden states (8 x 128 tokens) through the final norm, the head and the loss,
forward and backward, on each side's path (`DecoderStage.loss_sum`, fused in chunks; `F.cross_entropy` of
`lm_head`'s logits): the most bytes the tensors made during the call held at once (on CPU counted from the
tensors' storages as they are made and freed; on CUDA `max_memory_allocated` above the start).
"""

from __future__ import annotations

import statistics
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from trainyard.parallel.data.datasets import open_dataset
from trainyard.parallel.models.whole import GPTStage, full_model
from trainyard.parallel.runtime.distributed import shutdown_distributed

from bench import gpu
from bench.context import BenchContext
from bench.results import Row, at_least, ratio

ROUNDS, STEPS, WARMUP = 6, 2, 2


class LiveBytes(TorchDispatchMode):
    """The most bytes that tensors made while it is entered held at once (each storage counted once, until freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def loss_peak_bytes(loss: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> int:
    """Peak bytes made by `loss(hidden)` and its backward (module doc)."""
    h = hidden.detach().requires_grad_()
    if h.is_cuda:
        torch.cuda.synchronize(h.device)
        start = torch.cuda.memory_allocated(h.device)
        torch.cuda.reset_peak_memory_stats(h.device)
        loss(h).backward()
        torch.cuda.synchronize(h.device)
        return torch.cuda.max_memory_allocated(h.device) - start
    with LiveBytes() as meter:
        loss(h).backward()
    return meter.peak


def loss_peaks(cfg_model, device: torch.device, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, int]:
    model: GPTStage = full_model(cfg_model, seed=0).to(device)
    with torch.no_grad():
        hidden = model(inputs)
    return {"trainyard": loss_peak_bytes(lambda h: model.loss_sum(h, targets), hidden),
            "plain": loss_peak_bytes(lambda h: F.cross_entropy(model.lm_head(model.ln_f(h)).flatten(0, 1),
                                                               targets.flatten(), reduction="sum"), hidden)}


def run_section(ctx: BenchContext) -> list[Row]:
    rounds = 2 if ctx.quick else (ctx.rounds or ROUNDS)
    setup = gpu.setup_from_args(["--small", "--device", "cpu", "--threads", "1", "--warmup", str(WARMUP),
                                 "--steps", str(STEPS), "--rounds", str(rounds)])
    args, device, plan, shares = setup.args, setup.device, setup.plan, setup.shares
    cfg = plan.config
    tokens = cfg.global_batch * cfg.model.seq_len
    try:
        side, _, _ = gpu._trainyard_side(plan, device, shares)
        batches = gpu.device_batches(open_dataset(cfg), device, shares)
        sides = [side, gpu._plain_side(cfg, device, setup.precision, batches, gpu.PLAIN)]
        for s in sides:
            gpu._warm_up(s, args, device)
        times = gpu._measure(sides, args, device, tokens)
        losses = {s.name: s.losses() for s in sides}
    finally:
        shutdown_distributed()
    rates = {name: statistics.median(args.steps * tokens / t for t in block) for name, block in times.items()}
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["trainyard"], losses["plain"], strict=True))
    peaks = loss_peaks(cfg.model, device, *batches[0][0])
    m = cfg.model
    model = (f"GPT {m.n_layer} blocks, d_model {m.d_model}, {m.n_head} heads, vocab {m.vocab_size}, "
             f"{cfg.global_batch} x {m.seq_len} tokens a step")
    ctx.log(f"tokens/s trainyard {rates['trainyard']:,.0f}, plain {rates['plain']:,.0f}; losses differ by at most "
            f"{diff:.1e} (relative); loss peak {peaks['trainyard'] / 2**20:.1f} MiB vs {peaks['plain'] / 2**20:.1f}")
    return [
        Row("step: trainyard's one-rank step vs a plain torch loop, tokens/s", rates["trainyard"], rates["plain"],
            ratio(rates["trainyard"], rates["plain"]), "tokens/s",
            f"CPU, fp32, 1 thread; {model}; bench.gpu's sides, median of {rounds} rotating rounds of {STEPS} steps "
            f"after {WARMUP} warm-up; losses equal to {diff:.0e} (relative)", target=at_least(0.97, of="ratio")),
        Row("step: peak bytes of the loss computation, fused vs torch's cross-entropy", peaks["trainyard"] / 2**20,
            peaks["plain"] / 2**20, ratio(peaks["trainyard"], peaks["plain"]), "MiB",
            f"one micro-batch ({tokens:,} tokens, vocab {m.vocab_size}): final norm, head and loss, forward and "
            "backward; the tensors the call made, at most at once"),
    ]
