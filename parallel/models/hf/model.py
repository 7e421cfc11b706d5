"""The transformers backend's stage: a Hugging Face causal LM's own modules as the one pipeline stage of a job.

`HFStage(cfg, seed=)` builds `AutoModelForCausalLM.from_config(cfg.hf_config)` (`build`: fp32, dropout off) and
holds its children under their own names, so its parameter names are the model's (`names` maps them to a
checkpoint's). It offers what a `parallel.models.components.decoder.DecoderStage` offers the trainer at pp = 1 (first
and last at once): `forward(tokens)` is the model's body (`get_decoder()`: with transformers' own masks and positions),
`loss_sum(hidden, targets)` the summed cross-entropy of the model's logits, `shard_units()` the input embedding,
each decoder layer (`structure.decoder_layers`) and the rest with the output embedding,
`set_activation_checkpointing("full")` transformers' per-layer checkpointing, and `reset_buffers`. The embeddings
are the model's own (`get_input_embeddings()`, `get_output_embeddings()`), tied as its own `tie_weights` ties them;
no module name is assumed.

The loss: where the head is proved plain (`head.head_form`: logits = hidden @ W_out.T), the fused, chunked
cross-entropy (`parallel.models.components.loss`, no full fp32 logits) while the weight is whole on the rank; otherwise,
or with the weight sharded (ZeRO-3), the model's own head (`head.HeadForward`: its forward from the body's output, so
soft-capping, logit scaling, biases are the architecture's code) and the cross-entropy of its logits.

Built under `torch.device("meta")` (the trainer's construction), the parameters are meta but the buffers (rotary
frequencies, Gemma's embedding scale) are computed on the CPU as transformers computes them and kept, so
`reset_buffers` restores them after `parallel.runtime.materialize`'s `to_empty`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.components.loss import IGNORE_INDEX, linear_cross_entropy_sum
from trainyard.parallel.models.hf.build import hf_model
from trainyard.parallel.models.hf.head import HeadForward, body_of
from trainyard.parallel.models.hf.structure import decoder_layers, structure

__all__ = ["HFStage", "element_counts", "hf_model", "parameter_shapes"]


def _in_meta_context() -> bool:
    return torch.empty(()).device.type == "meta"


class HFStage(nn.Module):
    """A whole transformers causal LM as one stage (pp = 1: first and last)."""

    RESIDUAL: tuple[str, ...] = ()
    EMBEDDING = ""
    first = True
    last = True
    tied_copy = False
    init_aliases: dict[str, str] = {}

    body: Any
    """The model's body (`get_decoder`): embedding, decoder layers, final norm (a transformers module)."""
    head: Any
    """The output embedding (`get_output_embeddings`)."""
    embedding: Any
    """The input embedding (`get_input_embeddings`)."""
    logits: HeadForward
    """The model's own logits from the body's last hidden states (its head, as its forward runs it)."""

    def __init__(self, cfg: ModelConfig, *, seed: int):
        super().__init__()
        assert cfg.hf_config is not None
        self.cfg = cfg
        hf = hf_model(cfg, meta=_in_meta_context())
        for name, child in hf.named_children():  # the model's names: `model.layers.0...`, `lm_head.weight`
            self.add_module(name, child)
        self._buffers_at_build = {name: b.detach().clone() for name, b in self.named_buffers()}
        # Plain attributes, not children: registered twice, a module's parameters would get a second name.
        self.__dict__.update(body=body_of(hf), head=hf.get_output_embeddings(),
                             embedding=hf.get_input_embeddings(), logits=HeadForward(hf))
        self.plain_head = structure(cfg.hf_config).head.plain
        self.layers: list[Any] = decoder_layers(hf)
        if len(self.layers) != cfg.n_layer:
            raise ValueError(f"{type(hf).__name__}: found {len(self.layers)} decoder layers, config.json says "
                             f"{cfg.n_layer}")
        self.recompute_blocks = False  # transformers' own per-layer checkpointing (`set_activation_checkpointing`)
        self.offload_blocks = False
        self.compiled_blocks = False

    @property
    def blocks(self) -> dict[str, nn.Module]:
        """The decoder layers by global index (what `parallel.runtime.compile` compiles)."""
        return {str(i): layer for i, layer in enumerate(self.layers)}

    def reset_buffers(self) -> None:
        """The buffers as transformers computed them at construction (`to_empty` leaves them uninitialised)."""
        with torch.no_grad():
            for name, b in self.named_buffers():
                b.copy_(self._buffers_at_build[name])

    def shard_units(self) -> list[list[nn.Module]]:
        """The input embedding, each decoder layer, and the output embedding with every other module that holds
        parameters of its own (a final norm, learned positions); a tied head and embedding are one unit, listed
        where it runs first and last (as `DecoderStage.shard_units`)."""
        inside = {id(p) for m in (self.embedding, self.head, *self.layers) for p in m.parameters()}
        rest = [m for m in self.modules() if m is not self and m is not self.head
                and any(id(p) not in inside for p in m.parameters(recurse=False))]
        head = [*rest, self.head]
        layers = [[layer] for layer in self.layers]
        if self.head.weight is self.embedding.weight:
            tied = [self.embedding, *head]
            return [tied, *layers, tied]
        return [[self.embedding], *layers, head]

    def set_activation_checkpointing(self, mode: str) -> None:
        """full: transformers' per-layer checkpointing (each layer's input kept, the rest recomputed in backward);
        selective is refused by the family's rules (it needs a native family's recompute flags)."""
        for layer in self.layers:
            layer.gradient_checkpointing = mode == "full"
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)

    def set_activation_offload(self, on: bool) -> None:
        self.offload_blocks = on

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> the body's last hidden states."""
        with (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if self.offload_blocks
              else contextlib.nullcontext()):
            return self.body(input_ids=tokens, use_cache=False).last_hidden_state

    def loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the model's logits (targets of -100 count nothing): fused with the head where
        the head is proved plain and its weight is whole here, else through the model's own head."""
        weight: torch.Tensor = self.head.weight
        if self.plain_head and not isinstance(weight, DTensor):
            return linear_cross_entropy_sum(hidden, weight, targets)
        logits = self.logits(hidden).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model (a tied head once, under the embedding's name) -> its shape."""
    assert cfg.hf_config is not None
    return dict(structure(cfg.hf_config).shapes)


def element_counts(cfg: ModelConfig) -> tuple[int, int, tuple[int, ...]]:
    """(all parameter elements, the input embedding's, each decoder layer's)."""
    assert cfg.hf_config is not None
    s = structure(cfg.hf_config)
    return sum(_numel(shape) for shape in s.shapes.values()), s.embedding, s.layers


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
