"""The baseline of the dp section: a plain torchrun + DistributedDataParallel training loop, timed per step.

Launched by bench/dp.py as
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        bench/ddp_baseline.py --spec bench/dp2.yaml --out <file.json>
it trains the JobSpec's model on the same samples with the same optimizer as a trainyard job would:
`parallel.models.whole.full_model` (same init), `parallel.data.datasets` (same global batch per step, same rank shares),
`parallel.optim.optimizer` (same AdamW groups, learning-rate schedule and clipping). Rank 0 writes one record per
step (wall time and its phases, loss, grad norm) to `--out`.

Gradient sync, `--grad-sync`:
- `ddp` (the baseline): DDP all-reduces buckets while backward still runs. DDP averages, so the per-rank
  loss is `loss_sum / tokens_per_step * dp`, which makes the averaged gradient the global-batch mean.
- `after-backward` (a diagnostic): no DDP; trainyard's own `parallel.runtime.dp.data_parallel.GradientReducer`
  (bucketed SUM, after backward, by gloo's all-reduce: shared memory off) on a loss of
  `loss_sum / tokens_per_step`, i.e. trainyard's math without Ray, so the difference to `ddp` is the value of
  overlapping the all-reduce with backward.

Like a trainyard worker, every step also all-reduces the loss (so both sides report the global-batch loss
and the harness can check that both sides computed the same thing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from trainyard.parallel.config import JobConfig
from trainyard.parallel.data.datasets import Dataset, load_batch, open_dataset
from trainyard.parallel.data.sampler import global_batch_ids, rank_share
from trainyard.parallel.models.whole import GPTStage, full_model
from trainyard.parallel.optim.lr_schedules import lr_at
from trainyard.parallel.optim.optimizer import clip_grad_norm, make_optimizer, set_lr
from trainyard.parallel.runtime.dp.data_parallel import GradientReducer
from trainyard.parallel.spec import load_spec_text, parse_spec

GRAD_SYNCS = ("ddp", "after-backward")


class LossModel(nn.Module):
    """The GPT with its summed loss inside forward, so DDP sees every parameter used in one forward call."""

    def __init__(self, gpt: GPTStage):
        super().__init__()
        self.gpt = gpt

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.gpt.loss_sum(self.gpt(inputs), targets)


@dataclass
class StepRecord:
    step: int
    step_time_s: float
    forward_s: float
    """Reading the micro-batches and the forward passes."""
    backward_s: float
    """Backward passes; with DDP this includes waiting for the all-reduce buckets still in flight."""
    grad_sync_s: float
    """The explicit all-reduce after backward (after-backward only; 0 with DDP)."""
    update_s: float
    """Clipping, learning rate, AdamW step and the loss all-reduce."""
    loss: float
    grad_norm: float


class Trainer:
    def __init__(self, cfg: JobConfig, grad_sync: str):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.model = LossModel(full_model(cfg.model, cfg.seed))
        self.params = list(self.model.parameters())
        self.ddp = DistributedDataParallel(self.model) if grad_sync == "ddp" else None
        self.buckets = GradientReducer([self.params], dist.group.WORLD) if self.ddp is None else None
        self.net: nn.Module = self.ddp if self.ddp is not None else self.model
        self.optimizer = make_optimizer([(p, p) for p in self.params], cfg.optimizer)
        self.dataset: Dataset = open_dataset(cfg)
        tokens_per_step = cfg.global_batch * cfg.model.seq_len
        # DDP averages gradients over ranks: scale by dp so the average is the global-batch mean gradient.
        self.loss_scale = (self.world if self.ddp is not None else 1) / tokens_per_step
        self.tokens_per_step = tokens_per_step

    def step(self, step: int) -> StepRecord:
        cfg = self.cfg
        ids = global_batch_ids(cfg.seed, step, cfg.global_batch, self.dataset.num_samples)
        microbatches = rank_share(ids, self.rank, self.world, cfg.parallel.microbatches)
        dist.barrier()
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        forward_s = backward_s = 0.0
        loss_sum = torch.zeros(())
        for i, mb in enumerate(microbatches):
            t0 = time.perf_counter()
            inputs, targets = load_batch(self.dataset, mb)
            with self._sync_context(last=i == len(microbatches) - 1):
                loss = self.net(inputs, targets)
                t1 = time.perf_counter()
                (loss * self.loss_scale).backward()
            t2 = time.perf_counter()
            forward_s, backward_s = forward_s + t1 - t0, backward_s + t2 - t1
            loss_sum += loss.detach() / self.tokens_per_step
        t0 = time.perf_counter()
        if self.buckets is not None:
            self.buckets.finish()
        t1 = time.perf_counter()
        grad_norm = float(clip_grad_norm([(p.grad, 1.0) for p in self.params], cfg.optimizer.grad_clip))
        set_lr(self.optimizer, lr_at(step, cfg.optimizer, cfg.steps))
        self.optimizer.step()
        dist.all_reduce(loss_sum)
        end = time.perf_counter()
        return StepRecord(step=step, step_time_s=end - start, forward_s=forward_s, backward_s=backward_s,
                          grad_sync_s=t1 - t0, update_s=end - t1, loss=float(loss_sum), grad_norm=grad_norm)

    def _sync_context(self, *, last: bool) -> contextlib.AbstractContextManager:
        """DDP accumulates micro-batches locally and all-reduces only in the last one's backward."""
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="JobSpec file (YAML)")
    p.add_argument("--out", required=True, help="JSON file rank 0 writes the per-step records to")
    p.add_argument("--grad-sync", choices=GRAD_SYNCS, default="ddp")
    args = p.parse_args()
    cfg = parse_spec(load_spec_text(Path(args.spec).read_text()))
    dist.init_process_group("gloo")
    try:
        if dist.get_world_size() != cfg.parallel.dp:
            raise SystemExit(f"{args.spec} asks for dp={cfg.parallel.dp}, torchrun started {dist.get_world_size()}")
        trainer = Trainer(cfg, args.grad_sync)
        records = [trainer.step(step) for step in range(cfg.steps)]
        if dist.get_rank() == 0:
            out = {"grad_sync": args.grad_sync, "torch_threads": torch.get_num_threads(),
                   "steps": [asdict(r) for r in records]}
            Path(args.out).write_text(json.dumps(out, indent=1))
        dist.barrier()  # leave together: a peer tearing gloo down early can abort a rank still writing
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
