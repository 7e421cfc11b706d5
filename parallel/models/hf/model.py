"""The transformers backend's stage: a Hugging Face causal LM's own modules as the one pipeline stage of a job.

`HFStage(cfg, seed=)` builds `AutoModelForCausalLM.from_config(cfg.hf_config)` and holds its children under their
own names (`model`, `lm_head` for most architectures), so its parameter names are the checkpoint's: `init_from`,
DCP checkpoints and export map them one to one. It offers what a `parallel.models.decoder.DecoderStage` offers the
trainer at pp = 1 (first and last at once): `forward(tokens)` is the model's body (embedding, decoder layers, final
norm, with transformers' own masks and positions), `loss_sum(hidden, targets)` the head fused with the summed
cross-entropy (`parallel.models.loss`, no full fp32 logits), `shard_units()` the embedding, each decoder layer (the
classes `_no_split_modules` names) and the final norm with the head, `set_activation_checkpointing("full")`
transformers' per-layer checkpointing, and `reset_buffers`.

Built under `torch.device("meta")` (the trainer's construction), the parameters are meta but the buffers (rotary
frequencies, Gemma's embedding scale) are computed on the CPU as transformers computes them (accelerate's
`init_empty_weights(include_buffers=False)` trick: a parameter is moved to meta as it is registered) and kept, so
`reset_buffers` restores them after `parallel.runtime.materialize`'s `to_empty`.

A head with more than a matmul (Gemma 2's final logit soft-capping, a biased head) takes the unfused path: its
logits are made whole, as transformers does.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.loss import IGNORE_INDEX, linear_cross_entropy_sum


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside moves to the meta device; buffers stay where they are made (the CPU)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters[name]
        if p is not None and not p.is_meta:  # a meta one may be another module's (a tied head): kept as it is
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    setattr(nn.Module, "register_parameter", on_meta)  # noqa: B010 - a method patched for the construction only
    try:
        with torch.device("cpu"):
            yield
    finally:
        setattr(nn.Module, "register_parameter", register)  # noqa: B010


def hf_model(cfg: ModelConfig, *, meta: bool = False) -> Any:
    """`AutoModelForCausalLM.from_config` of the job's config.json, in fp32; `meta`: parameters on meta, buffers
    computed on the CPU. (Any: a transformers PreTrainedModel, from an optional package.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    assert cfg.hf_config is not None, "the hf family's ModelConfig carries its config.json (hf_config)"
    fields = json.loads(cfg.hf_config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with _parameters_on_meta() if meta else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


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
    embedding: Any
    norm: nn.Module | None

    def __init__(self, cfg: ModelConfig, *, seed: int):
        super().__init__()
        self.cfg = cfg
        hf = hf_model(cfg, meta=_in_meta_context())
        for name, child in hf.named_children():  # the checkpoint's names: `model.layers.0...`, `lm_head.weight`
            self.add_module(name, child)
        self._buffers_at_build = {name: b.detach().clone() for name, b in self.named_buffers()}
        # Plain attributes, not children: registered twice, a module's parameters would get a second name.
        body = hf.get_decoder()
        self.__dict__.update(body=body, head=hf.get_output_embeddings(), embedding=body.get_input_embeddings())
        self.softcap: float | None = getattr(hf.config, "final_logit_softcapping", None)
        self.layers: list[Any] = [m for m in body.modules() if type(m).__name__ in set(hf._no_split_modules or ())]
        if len(self.layers) != cfg.n_layer:
            raise ValueError(f"{type(hf).__name__}: found {len(self.layers)} decoder layers from _no_split_modules "
                             f"{hf._no_split_modules}, config.json says {cfg.n_layer}")
        self.__dict__["norm"] = next((m for name, m in body.named_children()
                                      if name in ("norm", "final_layernorm", "ln_f")), None)
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
        """The embedding, each decoder layer, the final norm with the head; a tied head and embedding are one unit,
        listed where it runs first and last (as `DecoderStage.shard_units`)."""
        head = [m for m in (self.norm, self.head) if m is not None]
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
        """Token ids (batch, seq) -> the body's last hidden states (after its final norm)."""
        with (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if self.offload_blocks
              else contextlib.nullcontext()):
            return self.body(input_ids=tokens, use_cache=False).last_hidden_state

    def loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the head's logits (targets of -100 count nothing): fused with the head unless
        the head does more than a matmul or FSDP2 holds its weight sharded (then through the module's hooks)."""
        weight: torch.Tensor = self.head.weight
        plain = self.softcap is None and getattr(self.head, "bias", None) is None
        if plain and not isinstance(weight, DTensor):
            return linear_cross_entropy_sum(hidden, weight, targets)
        logits = self.head(hidden).float()
        if self.softcap is not None:  # transformers' Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


@functools.lru_cache(maxsize=8)
def _shapes(hf_config: str) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], int, tuple[int, ...]]:
    """(every parameter's name and shape, the embedding's elements, each decoder layer's elements) of the model
    config.json describes, built on the meta device (no storage: cheap at any size)."""
    from trainyard.parallel.config import ModelConfig as Cfg

    cfg = Cfg(family="hf", n_layer=1, n_head=1, d_model=1, hf_config=hf_config)
    with torch.device("meta"):
        hf = hf_model(cfg, meta=True)
    names = tuple((name, tuple(p.shape)) for name, p in hf.named_parameters())
    embedding = hf.get_input_embeddings().weight.numel()
    kinds = set(hf._no_split_modules or ())
    layers = tuple(sum(p.numel() for p in m.parameters()) for m in hf.modules() if type(m).__name__ in kinds)
    return names, embedding, layers


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model (a tied head once, under the embedding's name) -> its shape."""
    assert cfg.hf_config is not None
    return dict(_shapes(cfg.hf_config)[0])


def element_counts(cfg: ModelConfig) -> tuple[int, int, tuple[int, ...]]:
    """(all parameter elements, the embedding's, each decoder layer's)."""
    assert cfg.hf_config is not None
    names, embedding, layers = _shapes(cfg.hf_config)
    return sum(_numel(shape) for _, shape in names), embedding, layers


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
