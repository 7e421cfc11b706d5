"""The GPT decoder, built as a slice of blocks so a pipeline stage holds exactly its own layers.

`GPTStage(cfg, layers, first, last)` holds the token/position embedding when it is the first stage,
the blocks whose *global* indices are in `layers` (kept in a ModuleDict keyed by that index, so a
parameter has the same name on every layout and checkpoints can be resharded), and the final norm and
head when it is the last stage. The whole model is simply the stage that is both first and last.

Initialisation depends only on the job seed and each parameter's name, never on the layout: every
parameter draws from its own generator seeded by (seed, name).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from parallel.config import ModelConfig
from parallel.layers import MLP, CausalSelfAttention
from parallel.moe import MoELayer
from parallel.seeds import derive_seed


class Block(nn.Module):
    """Pre-LayerNorm transformer block; its feed-forward part is an MLP, or an MoE layer hosting `experts`."""

    def __init__(self, cfg: ModelConfig, experts: Iterable[int] | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        if experts is None:
            self.mlp = MLP(cfg)
        else:
            self.moe = MoELayer(cfg, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + ffn(self.ln_2(x))


class GPTStage(nn.Module):
    """A contiguous run of blocks, plus the embedding on the first stage and the head on the last."""

    def __init__(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, seed: int,
                 experts: Iterable[int] | None = None):
        """`experts`: the global indices of the experts this stage's MoE blocks host (default: all)."""
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        if first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        hosted = list(range(cfg.moe.experts) if experts is None else experts) if cfg.moe else []
        self.blocks = nn.ModuleDict({str(i): Block(cfg, hosted if cfg.is_moe_block(i) else None) for i in layers})
        if last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings and first:
                self.lm_head.weight = self.wte.weight
        init_parameters(self, seed=seed, n_layer=cfg.n_layer)
        self.recompute_blocks = False

    def set_activation_checkpointing(self, mode: str) -> None:
        """none, full (recompute each block in backward: only block inputs are kept) or selective (see
        `parallel.layers`: the attention core and the MLP activations, the experts' included)."""
        self.recompute_blocks = mode == "full"
        for module in self.modules():
            if isinstance(module, CausalSelfAttention | MLP):
                module.recompute = mode == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states (later stages) -> hidden states."""
        if self.first:
            x = self.embed(x)
        for block in self.blocks.values():
            x = checkpoint(block, x, use_reentrant=False) if self.recompute_blocks else block(x)
        return x

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token plus learned position embeddings of (batch, seq) token ids."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)

    def loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed (not averaged) cross-entropy: the caller divides by the global token count.

        With tensor parallelism the logits are a DTensor sharded over the vocabulary and the caller runs this
        and its backward under `loss_parallel`; the loss is then a replicated DTensor, returned as its local
        value, which is the whole loss.
        """
        logits = self.lm_head(self.ln_f(hidden))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return loss.to_local() if isinstance(loss, DTensor) else loss


def full_model(cfg: ModelConfig, seed: int) -> GPTStage:
    """The unsharded model: one stage holding everything."""
    return GPTStage(cfg, range(cfg.n_layer), first=True, last=True, seed=seed)


@torch.no_grad()
def init_parameters(module: nn.Module, *, seed: int, n_layer: int) -> None:
    """GPT-2 init, each parameter from its own (seed, name) generator so the layout cannot matter."""
    for name, p in module.named_parameters():
        gen = torch.Generator().manual_seed(derive_seed(seed, "param", name))
        if name.endswith("bias"):
            p.zero_()
        elif ".ln_" in name or name.startswith("ln_f"):
            p.fill_(1.0)
        else:
            # Residual projections are scaled down by depth (GPT-2), keeping the residual stream's variance flat.
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)
