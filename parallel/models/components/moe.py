"""Mixture-of-experts layers: top-k routing, capacity, the auxiliary losses, and expert parallelism.

`MoELayer` takes the place of the MLP in every `moe.every`-th block. A bias-free router scores the
experts of each token; the token goes to its `top_k` best, and their softmax probabilities, renormalised
over the chosen k (unless `moe.norm_topk_prob` is false, as in some Qwen3-MoE checkpoints), weigh the experts'
outputs. Experts are the model family's expert module (its stage class's `expert`:
gpt2's GELU MLP, llama's SwiGLU), held in a ModuleDict keyed by their *global* index, so a parameter is named
`blocks.3.moe.experts.5.fc.weight` on every layout and a rank holds only the experts it hosts.

Layout independence. Which tokens an expert keeps is decided within a routing group that is the same in
every layout: one sequence. With `capacity_factor` set, expert e keeps at most
ceil(capacity_factor x seq_len x top_k / experts) of a sequence's tokens, earlier positions first; a token
over the cap skips that expert (its other choices still count, and the block's residual carries it).
`capacity_factor: null` keeps every token (dropless). The auxiliary losses are computed per sequence too and
normalised like the token loss (by the step's sequences and tokens, not the micro-batch's):
- load balancing (Switch/GShard): E x sum_e f_e P_e per sequence, f_e the fraction of the sequence's k x
  seq_len assignments routed to e (before capacity), P_e its mean router probability for e; 1 when
  perfectly balanced. The step's value is the mean over its sequences.
- router z-loss (ST-MoE): the squared log-sum-exp of each token's router logits, mean over the step's tokens.
Both join the training loss inside the block (`_AddLoss`, Megatron's aux-loss scaler): the block's output
carries them into backward, whichever pipeline stage it runs on, and the executor does not change.

Expert parallelism. The ep ranks of a group (dp ranks with the same pp and tp coordinates, see
`parallel.plan`) each host experts / ep experts. Dropless, a rank sorts its (token, expert) assignments by
expert, exchanges the per-expert counts with `all_to_all_single`, sends each rank the rows for its experts
(uneven splits), runs its experts and sends the outputs back the same way; with a capacity it sends each rank
its experts' fixed-size buffers (equal splits, no counts). Autograd reverses both exchanges in backward.
Expert gradients are then summed over the ranks that hold the same experts and the router's over the whole
stage (`parallel.runtime.trainer`).

Tensor parallelism. The tp ranks of a group do not duplicate the routing work: each routes and dispatches
only its slice of the sequence (with sp it holds just that slice; without sp `parallel.runtime.tp.tensor_parallel`
hands the layer its slice and all-gathers the output). Capacity needs the sequence's earlier positions, so
the ranks exchange their per-expert counts (a few integers) and each counts the slices before its own;
the load-balancing loss is linear in P, so each rank adds its slice's share with the whole sequence's f,
and the shares sum to the loss. Experts are not sharded over tp: each tp rank holds whole experts and
computes its own tokens; their gradients are summed over tp with the data-parallel ones.

Dispatch and the host. Dropless, a layer sorts its (token, expert) assignments by expert and reads the
per-expert counts to the host once per call (with ep, after the counts' exchange, its own and the incoming
together): the experts' row splits and the exchange's need them. With a capacity nothing is read: each expert
gets a buffer of min(capacity, slice length) rows per sequence of the micro-batch, a kept choice goes to the row
of its place in the expert's queue, and the experts compute on the whole buffers (the empty rows are zeros nobody
reads); with ep the buffers travel in equal splits (micro-batches are equal over dp). The experts run as grouped
matmuls where the device has a kernel for it (`parallel.models.components.grouped`; the counts' offsets go back to the
device without waiting for it, `parallel.models.components.transfers`), one after another elsewhere.

Written by hand because torch has no MoE layer. The token exchange is `dist.all_to_all_single` in a
five-line autograd Function (`_Exchange`), as `torch.distributed.nn.functional.all_to_all_single` does:
that one is deprecated, and its functional replacement returns lazily waited tensors that the pipeline's
saved-tensor meter cannot inspect.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.components.grouped import use_grouped_mm
from trainyard.parallel.models.components.transfers import to_device

N_STAT_SLOTS = 4
"""Per-layer statistics before the per-expert loads: aux sum, z sum, dropped and all assignments."""


def capacity(cfg: ModelConfig) -> int | None:
    """Most tokens of one sequence an expert keeps; None when dropless."""
    moe = cfg.moe
    if moe is None or moe.capacity_factor is None:
        return None
    return math.ceil(moe.capacity_factor * cfg.seq_len * moe.top_k / moe.experts)


@dataclass
class MoEContext:
    """How a layer's work is split: the groups it talks on and the normaliser of its losses."""

    sequences_per_step: int | None = None
    """Sequences in the whole step (the losses' normaliser); None: the sequences of each call."""
    tp_group: dist.ProcessGroup | None = None
    """The tensor-parallel group; each of its ranks holds one slice of every sequence, in rank order."""
    ep_group: dist.ProcessGroup | None = None
    """The expert-parallel group; rank j of it hosts experts [j E/ep, (j+1) E/ep)."""


class MoELayer(nn.Module):
    stats: torch.Tensor
    """A buffer (`register_buffer` in __init__)."""

    def __init__(self, cfg: ModelConfig, experts: Iterable[int], expert: Callable[[ModelConfig], nn.Module]):
        """`experts`: the global indices of the experts this layer hosts; `expert(cfg)` builds one (the model
        family's stage class's `expert`: this module knows no family, as the families build it)."""
        super().__init__()
        assert cfg.moe is not None
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.moe.experts, cfg.moe.top_k
        self.router = nn.Linear(cfg.d_model, self.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): expert(cfg) for e in sorted(experts)})
        self.context = MoEContext()
        self.grouped_mm: bool | None = None
        """Run the experts as grouped matmuls: None where `parallel.models.components.grouped` says the device has a
        kernel for it; True or False to force it (tests compare the two paths)."""
        # Sums over a step's calls (see `summarize`), zeroed by the trainer at each step's start. A buffer so
        # it moves with the module; not persistent: it is no part of the model.
        self.register_buffer("stats", torch.zeros(N_STAT_SLOTS + self.n_experts, dtype=torch.float64),
                             persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """`stats` zeroed (after `to_empty`, on a stage built on the meta device)."""
        self.stats.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        moe = self.cfg.moe
        assert moe is not None, "an MoE layer's model has an moe section"
        if moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        # (b, t, E): 1 where the token chose the expert (its k choices are distinct). A scatter, not F.one_hot,
        # which reads its indices' range back to the host.
        assigned = torch.zeros((b, t, self.n_experts), dtype=torch.long, device=x.device).scatter_(2, chosen, 1)
        counts = assigned.sum(1)  # (b, E) this slice's tokens per expert, before capacity
        before, whole = self._sequence_counts(counts)
        seq_len = t * _size(self.context.tp_group)
        # Place of each choice in its expert's queue within this slice (tokens at earlier positions first).
        place = (assigned.cumsum(1) - assigned).gather(2, chosen)
        cap = capacity(self.cfg)
        keep = torch.ones_like(chosen, dtype=torch.bool) if cap is None else before.gather(1, chosen.flatten(1)).view(
            chosen.shape) + place < cap

        # This slice's share of the losses (summed over a step's slices they are the sequences' losses).
        aux = self.n_experts / (seq_len * self.top_k * seq_len) * (whole.to(probs.dtype) * probs.sum(1)).sum()
        z = torch.logsumexp(logits, -1).pow(2).sum()
        sequences = self.context.sequences_per_step or b
        loss = moe.aux_loss_coef * aux / sequences + moe.z_loss_coef * z / (sequences * seq_len)

        flat = x.reshape(b * t, d)
        if cap is None:
            y = self._route_dropless(flat, chosen.reshape(-1), weights.reshape(-1), counts.sum(0))
        else:
            y = self._route_capacity(flat, chosen, weights, keep, place, min(cap, t))
        if torch._C._current_graph_task_id() == -1:  # not again when activation checkpointing recomputes it
            with torch.no_grad():
                self.stats[0] += aux.double()
                self.stats[1] += z.double()
                self.stats[2] += (~keep).sum()
                self.stats[3] += keep.numel()
                self.stats[N_STAT_SLOTS:] += counts.sum(0)
        return _AddLoss.apply(y.view(b, t, d).to(x.dtype), loss)

    def _sequence_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence and expert: the tokens of the slices before this one, and of the whole sequence."""
        group = self.context.tp_group
        if group is None:
            return torch.zeros_like(counts), counts
        slices = counts.new_empty((_size(group) * counts.shape[0], counts.shape[1]))
        dist.all_gather_into_tensor(slices, counts.contiguous(), group=group)
        slices = slices.view(-1, *counts.shape)  # [tp rank, sequence, expert]
        return slices[:dist.get_rank(group)].sum(0), slices.sum(0)

    def _route_dropless(self, x: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor,
                        counts: torch.Tensor) -> torch.Tensor:
        """Every (token, expert) assignment to its expert (sorted by expert, `counts` of each), the weighted
        outputs summed per token. The one host read: the counts, as the experts' row splits (`_experts`)."""
        order = torch.argsort(expert, stable=True)
        token = order // self.top_k
        out = self._experts(x[token], counts)
        # Summed in the stream's type (fp32), also when the experts ran under bf16 autocast.
        return torch.zeros_like(x).index_add(0, token, out.to(x.dtype) * weight[order].unsqueeze(1).to(x.dtype))

    def _route_capacity(self, x: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor,
                        place: torch.Tensor, slots: int) -> torch.Tensor:
        """With a capacity: fixed-size buffers, no host read. Expert e's buffer has `slots` rows per sequence of
        the micro-batch (at most its capacity, and at most the slice's length), a kept choice goes to the row of its
        place in the expert's queue, and the rows no choice fills are zeros the experts compute on and nobody reads.
        The dropped choices all go to one extra row, also unread."""
        b, t, k = chosen.shape
        n_slots = self.n_experts * b * slots
        sequence = torch.arange(b, device=x.device).view(b, 1, 1)
        slot = torch.where(keep, (chosen * b + sequence) * slots + place, n_slots).reshape(-1)
        rows = x.unsqueeze(1).expand(b * t, k, x.shape[1]).reshape(b * t * k, x.shape[1])
        buffer = x.new_zeros((n_slots + 1, x.shape[1])).index_add(0, slot, rows)
        per_expert = b * slots
        out = self._experts(buffer[:n_slots], None, per_expert)
        out = torch.cat([out.to(x.dtype), out.new_zeros((1, x.shape[1]), dtype=x.dtype)])
        gate = (weight * keep).reshape(-1, 1).to(x.dtype)
        token = torch.arange(b * t, device=x.device).repeat_interleave(k)
        return torch.zeros_like(x).index_add(0, token, out[slot] * gate)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor | None, per_expert: int = 0) -> torch.Tensor:
        """Rows sorted by expert -> each row through its expert, same order. `counts`: the rows of each expert
        (read to the host once); None: `per_expert` rows of each (fixed-size buffers, nothing read)."""
        group = self.context.ep_group
        if group is None:
            return self._local_experts(rows, counts.tolist() if counts is not None else [per_expert] * self.n_experts)
        ep, local = _size(group), len(self.experts)
        if counts is None:  # every rank's buffers have the same shape (micro-batches are equal over dp)
            even = [local * per_expert] * ep
            received = _Exchange.apply(rows, even, even, group)
            # [source rank, local expert, row] -> [local expert, source rank, row]: each expert's rows together
            by_expert = received.view(ep, local, per_expert, -1).transpose(0, 1).reshape(received.shape)
            out = self._local_experts(by_expert, [ep * per_expert] * local)
            out = out.view(local, ep, per_expert, -1).transpose(0, 1).reshape(out.shape)
            return _Exchange.apply(out, even, even, group)
        # Tell each rank how many rows of each of its experts are coming, then read both to the host at once.
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=group)
        both = torch.cat([counts, incoming]).tolist()
        mine, theirs = both[:self.n_experts], both[self.n_experts:]  # theirs: [source rank, local expert], flat
        send = [sum(mine[r * local:(r + 1) * local]) for r in range(ep)]
        recv = [sum(theirs[r * local:(r + 1) * local]) for r in range(ep)]
        received = _Exchange.apply(rows, recv, send, group)
        # Received rows are grouped by source, then expert: regroup by expert, run, and restore the order.
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
            incoming.flatten(), output_size=sum(recv))
        order = torch.argsort(expert_of_row, stable=True)
        out = torch.empty_like(received)
        out[order] = self._local_experts(received[order], [sum(theirs[e::local]) for e in range(local)])
        return _Exchange.apply(out, send, recv, group)

    def _local_experts(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Rows sorted by this rank's experts (`counts` of each) through them: one grouped matmul per weight where
        the device has one (`parallel.models.components.grouped`), else one expert after another."""
        experts = list(self.experts.values())
        grouped = getattr(type(experts[0]), "grouped", None) if experts else None
        # Recomputing experts (selective checkpointing) run as their modules, whose checkpointed regions they have.
        if grouped is not None and not any(getattr(e, "recompute", False) for e in experts) and (
                self.grouped_mm if self.grouped_mm is not None
                else use_grouped_mm(rows, next(experts[0].parameters()).shape[0])):  # (hidden, d_model) in each family
            offs = to_device(torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32), rows.device)
            return grouped(experts, rows, offs)
        outs = [expert(part) for expert, part in zip(experts, rows.split(list(counts)), strict=True)]
        return torch.cat(outs) if outs else rows

    def summarize(self, stats: torch.Tensor | Sequence[float], sequences: int) -> dict:
        """A step's statistics (this layer's `stats` summed over every rank of the stage, already read to the
        host by the trainer's one read of the step's figures, or a tensor) as metrics."""
        values = stats.tolist() if isinstance(stats, torch.Tensor) else list(stats)
        aux, z, dropped, assignments = values[:N_STAT_SLOTS]
        return {"aux_loss": aux / sequences, "z_loss": z / (sequences * self.cfg.seq_len),
                "dropped_fraction": dropped / assignments if assignments else 0.0,
                "load": [round(v) for v in values[N_STAT_SLOTS:]]}


class _AddLoss(torch.autograd.Function):
    """Identity on `out` whose backward also back-propagates `loss` with gradient 1, so a block's auxiliary
    loss joins the training loss wherever the block runs (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device  # not saved tensors: nothing to hold
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


class _Exchange(torch.autograd.Function):
    """`all_to_all_single` of rows with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        return _Exchange.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def moe_layers(module: nn.Module) -> list[tuple[str, MoELayer]]:
    """Every MoE layer in `module`, with its block's global index as a string."""
    return [(name.split(".")[1], m) for name, m in module.named_modules() if isinstance(m, MoELayer)]


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)
