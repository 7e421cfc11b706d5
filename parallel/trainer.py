"""One rank's training state and step: its model chunks, optimizer and data, and `train_step`.

This is everything a worker does, expressed with torch.distributed alone (no Ray), so it runs under
spawned processes in tests and under Ray actors in the service. A step: run this rank's micro-batches
(forward, backward, gradient accumulation), sum gradients across data-parallel replicas, clip the
global norm, set the learning rate and take an AdamW step.

The loss of every micro-batch is divided by the global batch's token count before backward, so summed
gradients equal the gradient of the global mean loss whatever the layout.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from parallel.data import load_batch, open_dataset
from parallel.data_parallel import allreduce_gradients
from parallel.distributed import RankGroups
from parallel.model import GPTStage
from parallel.optim import clip_grad_norm, lr_at, make_optimizer, set_lr
from parallel.plan import Plan


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float | None
    """Mean token loss of the global batch; only the last pipeline stage knows it (None elsewhere)."""
    grad_norm: float
    lr: float
    compute_s: float
    """Time this rank spent inside train_step."""

    def to_dict(self) -> dict:
        return asdict(self)


class RankTrainer:
    def __init__(self, plan: Plan, rank: int, groups: RankGroups, device: torch.device):
        cfg = plan.config
        self.plan, self.rank, self.groups, self.device = plan, rank, groups, device
        self.coords = plan.coords(rank)
        n_virtual = plan.n_virtual_stages
        self.chunks = [
            GPTStage(cfg.model, layers, first=(v == 0), last=(v == n_virtual - 1), seed=cfg.seed).to(device)
            for v, layers in ((c * plan.pp + self.coords.pp, plan.stage_layers[c * plan.pp + self.coords.pp])
                              for c in range(plan.vpp))
        ]
        self.params = [p for chunk in self.chunks for p in chunk.parameters()]
        self.optimizer = make_optimizer(self.chunks, cfg.optimizer)
        self.dataset = open_dataset(cfg)
        self.tokens_per_step = cfg.global_batch * cfg.model.seq_len

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.plan.pp - 1

    def train_step(self, step: int, microbatch_ids: list[list[int]]) -> StepStats:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        loss_sum = self._forward_backward(microbatch_ids)
        allreduce_gradients(self.params, self.groups.dp)
        grad_norm = clip_grad_norm(self.params, self.plan.config.optimizer.grad_clip, self.groups.pp)
        lr = lr_at(step, self.plan.config.optimizer, self.plan.config.steps)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        loss = None
        if self.is_last_stage:
            if self.groups.dp is not None:
                dist.all_reduce(loss_sum, group=self.groups.dp)
            loss = float(loss_sum)
        return StepStats(step=step, loss=loss, grad_norm=grad_norm, lr=lr, compute_s=time.perf_counter() - start)

    def _forward_backward(self, microbatch_ids: list[list[int]]) -> torch.Tensor:
        """Plain gradient accumulation over this rank's micro-batches (pp = 1)."""
        (chunk,) = self.chunks
        loss_sum = torch.zeros((), device=self.device)
        for ids in microbatch_ids:
            inputs, targets = load_batch(self.dataset, ids)
            hidden = chunk(inputs.to(self.device))
            loss = chunk.loss_sum(hidden, targets.to(self.device)) / self.tokens_per_step
            loss.backward()
            loss_sum += loss.detach()
        return loss_sum
