"""The decoder stage both families share: pre-norm blocks keyed by global index, embedding first, head last.

`DecoderStage(cfg, layers, first=, last=, seed=)` holds the embedding when it is the first stage, the blocks
whose *global* indices are in `layers` (a ModuleDict keyed by that index, so a parameter has the same name
on every layout and checkpoints can be resharded), and the final norm and head when it is the last stage.
The whole model is the stage that is both first and last. A family subclasses it and supplies its parts:
`norm`, `attention`, `feed_forward`, its embeddings (`build_embeddings`, `embed`) and which projections
feed the residual stream (`RESIDUAL`, scaled down at init).

What a stage offers the pipeline and the trainer: `forward(x)` (token ids on the first stage, hidden states
elsewhere), `loss_sum(hidden, targets)` (summed cross-entropy, ignore_index -100, fused with the head: no
full-size fp32 logits), `set_activation_checkpointing(mode)`, `set_documents(documents)` (packed examples),
`shard_units()` (what ZeRO-3 gathers together, in the order the forward runs it), and `cfg`, `first`, `last`,
`blocks`.

Initialisation depends only on the job seed and each parameter's name, never on the layout: every
parameter draws from its own generator seeded by (seed, name) (`initial_value`). A stage built under
`torch.device("meta")` (the trainer's construction, `parallel.runtime.materialize`) gets no values here: its
parameters are filled after sharding, each rank its own slices of the same whole values, and its buffers
(`reset_buffers`) recomputed.

Tied embeddings: a stage that is both first and last makes the head's weight the embedding's Parameter. A last
stage without the embedding (pp > 1, or another chunk of an interleaved rank) holds its own copy as the head
(`tied_copy`), drawn from the embedding's generator (`EMBEDDING`'s name), so the two start equal; the trainer keeps
them equal (`parallel.runtime.pipeline.tied`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from typing import ClassVar, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.components.documents import Documents, ReadsDocuments
from trainyard.parallel.models.components.loss import linear_cross_entropy_sum
from trainyard.parallel.models.components.moe import MoELayer
from trainyard.parallel.seeds import derive_seed


class Block(nn.Module):
    """Pre-norm transformer block; its feed-forward part is the family's MLP, or an MoE layer hosting
    `experts`."""

    def __init__(self, stage: type[DecoderStage], cfg: ModelConfig, experts: Iterable[int] | None = None):
        super().__init__()
        self.ln_1 = stage.norm(cfg)
        self.attn = stage.attention(cfg)
        self.ln_2 = stage.norm(cfg)
        self.is_moe = experts is not None
        if experts is not None:
            self.moe = MoELayer(cfg, experts, stage.expert)
        else:
            self.mlp = stage.feed_forward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + (self.moe if self.is_moe else self.mlp)(self.ln_2(x))


@runtime_checkable
class _Recomputes(Protocol):
    """A module with a selective-recompute part (a `recompute` flag; the attention core, the MLP activation)."""

    recompute: bool


@runtime_checkable
class _HasBuffers(Protocol):
    """A module whose buffers follow from the config alone (`reset_buffers` recomputes them in place)."""

    def reset_buffers(self) -> None: ...


class DecoderStage(nn.Module):
    """A contiguous run of blocks, plus the embedding on the first stage and the head on the last."""

    RESIDUAL: ClassVar[tuple[str, ...]] = ("proj.weight",)
    """Name endings of the projections that write into the residual stream (init scaled by depth)."""
    wte: nn.Embedding
    """The token embedding of a first stage (`build_embeddings`)."""
    EMBEDDING: ClassVar[str] = "wte.weight"
    """The token embedding's parameter name, which a tied head copy is initialised and checkpointed as."""

    @staticmethod
    def norm(cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def attention(cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def feed_forward(cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def expert(cls, cfg: ModelConfig) -> nn.Module:
        """One expert of an MoE block: the dense feed-forward module."""
        return cls.feed_forward(cfg)

    def build_embeddings(self, cfg: ModelConfig) -> None:
        raise NotImplementedError

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __init__(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, seed: int,
                 experts: Iterable[int] | None = None):
        """`experts`: the global indices of the experts this stage's MoE blocks host (default: all)."""
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        if first:
            self.build_embeddings(cfg)
        hosted = list(range(cfg.moe.experts) if experts is None else experts) if cfg.moe else []
        self.blocks = nn.ModuleDict({str(i): Block(type(self), cfg, hosted if cfg.is_moe_block(i) else None)
                                     for i in layers})
        if last:
            self.ln_f = self.norm(cfg)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings and first:
                self.lm_head.weight = self.wte.weight
        # On the meta device there is nothing to fill: `parallel.runtime.materialize` does it after sharding.
        if not any(p.is_meta for p in self.parameters()):
            init_parameters(self, seed=seed, n_layer=cfg.n_layer, residual=self.RESIDUAL, aliases=self.init_aliases)
        self.recompute_blocks = False
        self.offload_blocks = False
        self.compiled_blocks = False
        """Set by `parallel.runtime.compile.compile_blocks`."""
        self.documents: Documents | None = None
        """The packed documents of the micro-batch computed now (`set_documents`; gpt2's positions read them)."""

    def reset_buffers(self) -> None:
        """Recompute every buffer (rotary frequencies, MoE statistics) from the config: after `to_empty`, which
        leaves them uninitialised. Each module with buffers has a `reset_buffers` of its own."""
        for module in self.modules():
            if module is not self and isinstance(module, _HasBuffers):
                module.reset_buffers()

    @property
    def tied_copy(self) -> bool:
        """Whether the head's weight is this stage's own copy of a tied embedding held by another stage."""
        return self.cfg.tie_embeddings and self.last and not self.first

    @property
    def init_aliases(self) -> dict[str, str]:
        """Parameters drawn as another: a tied head copy as the embedding (the same values)."""
        return {"lm_head.weight": self.EMBEDDING} if self.tied_copy else {}

    def shard_units(self) -> list[list[nn.Module]]:
        """The modules ZeRO-2/3 gather and reduce together (one FSDP2 unit each), in the order the forward runs
        them: the embedding (whatever `build_embeddings` made), each block, the head (final norm and output
        projection). Tied embeddings on one stage make the embedding and the head one unit (they share a
        weight), listed twice: the same list object opens and closes the forward."""
        head = [self.ln_f, self.lm_head] if self.last else []
        embedding = [m for name, m in self.named_children() if name != "blocks" and m not in head
                     and next(m.parameters(), None) is not None]
        blocks = [[block] for block in self.blocks.values()]
        if self.first and self.last and self.cfg.tie_embeddings:
            tied = embedding + head
            return [tied, *blocks, tied]  # one unit, listed where it runs: first (embedding) and last (head)
        return [unit for unit in [embedding, *blocks, head] if unit]

    def set_activation_checkpointing(self, mode: str) -> None:
        """none, full (recompute each block in backward: only block inputs are kept) or selective (each
        family's attention core and MLP activation, the experts' included: modules with a `recompute` flag)."""
        self.recompute_blocks = mode == "full"
        for module in self.modules():
            if isinstance(module, _Recomputes):
                module.recompute = mode == "selective"

    def set_documents(self, documents: Documents | None) -> None:
        """The documents (positions, segments) of the packed micro-batch this stage computes next, or None: given to
        every module that reads them (`parallel.models.components.documents`), before each forward and backward
        action."""
        for module in self.modules():
            if isinstance(module, ReadsDocuments):
                module.documents = documents

    def set_activation_offload(self, on: bool) -> None:
        """Keep what the blocks save for backward in host memory (pinned when CUDA is available) until their
        backward needs it: torch's `save_on_cpu` (with recompute, what is still saved: the blocks' inputs
        under full, the kept tensors under selective)."""
        self.offload_blocks = on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states (later stages) -> hidden states."""
        if self.first:
            x = self.embed(x)
            if self.compiled_blocks and x._is_view():
                # A tp embedding's output is a view of its DTensor's local tensor (`to_local`). Taken as a compiled
                # block's input, its gradient reaches DTensor's backward as a plain tensor, which fails (torch
                # 2.13; gpt2 adds positions first, llama does not): hand the block a tensor of its own.
                x = x.clone()
        with (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if self.offload_blocks
              else contextlib.nullcontext()):
            for block in self.blocks.values():
                x = checkpoint(block, x, use_reentrant=False) if self.recompute_blocks else block(x)
        return x

    def loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed (not averaged) cross-entropy: the caller divides by the global token count. Targets of -100
        count nothing.

        The head and the loss are fused, a chunk of tokens at a time (`parallel.models.components.loss`): no full-size
        fp32 logits tensor exists, in forward or backward. With tensor parallelism the head's weight is a DTensor
        sharded over the vocabulary, the logits are one too, and the caller runs this and its backward under
        `loss_parallel` (each rank holds vocab / tp of the logits); the loss is then a replicated DTensor,
        returned as its local value, which is the whole loss. (A head whose weight is a DTensor for another
        reason, sharded by FSDP2 outside this call, takes the same unfused path, through the module's hooks.)
        """
        hidden = self.ln_f(hidden)
        if not isinstance(self.lm_head.weight, DTensor):
            return linear_cross_entropy_sum(hidden, self.lm_head.weight, targets)
        logits = self.lm_head(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return loss.to_local() if isinstance(loss, DTensor) else loss


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_dim) each; k and v may have fewer heads than q (grouped-query attention)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def initial_value(name: str, shape: Sequence[int], *, seed: int, n_layer: int,
                  residual: tuple[str, ...] = ("proj.weight",)) -> torch.Tensor:
    """The whole fp32 value parameter `name` starts from (GPT-2 init), on the CPU, from its own (seed, name)
    generator, so the layout cannot matter: biases 0, norms 1, the rest normal with std 0.02."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("ln_f"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(derive_seed(seed, "param", name))
    # Residual projections are scaled down by depth (GPT-2), keeping the residual stream's variance flat.
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(residual) else 0.02
    # In place: one whole tensor at a time is construction's transient (the memory plan's `construction`); the same
    # values as `randn(...) * std`.
    return torch.randn(tuple(shape), generator=gen).mul_(std)


@torch.no_grad()
def init_parameters(module: nn.Module, *, seed: int, n_layer: int, residual: tuple[str, ...] = ("proj.weight",),
                    aliases: dict[str, str] | None = None) -> None:
    """Every parameter of a whole (unsharded) module from `initial_value`. `aliases`: a parameter drawn as another
    (a tied head copy as the embedding: the same values)."""
    for name, p in module.named_parameters():
        name = (aliases or {}).get(name, name)
        p.copy_(initial_value(name, p.shape, seed=seed, n_layer=n_layer, residual=residual))
