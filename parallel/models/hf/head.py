"""The transformers backend's head: the model's own logits from the body's last hidden states, and the proof that
they are `hidden @ W_out.T` and nothing else (where the fused, chunked loss may replace them).

`HeadForward(hf)` runs the causal LM's own `forward` with its body (`get_decoder()`) replaced by a stand-in that
hands back the given hidden states: whatever the architecture does between its body and its logits (Granite's
`logits / logits_scaling`, Gemma 2's soft-capping, Cohere's `logit_scale`, a final norm or a scaling the head
owns, a bias) is the architecture's code, not the backend's. The head's modules are called as modules, so FSDP2's
hooks gather a sharded head as in any forward.

`head_form(hf)` proves, on the meta device (no storage, any size), which of the two the loss may use: it runs that
forward under a dispatch mode that follows every aten op from the hidden states and the output embedding's weight
to the logits. The logits are plain when they are that weight's transposed product with the hidden states, through
views alone (no bias, no scaling, no soft-capping, no norm); anything else is named (`HeadForm.why`) and the loss
takes the model's own logits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class _BodyOutput:
    """What a body returns, as far as a causal LM's forward reads it: the last hidden states (None for the rest)."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:  # hidden_states, attentions, router_logits...: none here
        return None

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.last_hidden_state,)[index]


class _Given(nn.Module):
    """The body's stand-in: it returns the hidden states it was given, whatever it is called with; any other
    attribute a head reads of its body (Falcon-H1's `lm_head_multiplier`) is the body's own."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None
        self.__dict__["body"] = body  # not a child: the head's copy of the model holds no second body

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["body"], name)

    def forward(self, *args: Any, **kwargs: Any) -> _BodyOutput:
        assert self.hidden is not None
        return _BodyOutput(self.hidden)


def body_of(hf: Any) -> Any:
    """The causal LM's body: `get_decoder()` (embedding, decoder layers, final norm), or, where that answers the
    causal LM itself (Llama 4's text model), its child that holds the input embedding."""
    body = hf.get_decoder()
    if body is not hf:
        return body
    embedding = hf.get_input_embeddings()
    return next((child for _, child in hf.named_children() if any(m is embedding for m in child.modules())), None)


def body_path(hf: Any) -> list[str] | None:
    """The names from the causal LM down to its body (one level down for most architectures, two for OPT's
    `model.decoder`); None when the body is not inside it."""
    body = body_of(hf)
    for name, module in hf.named_modules():
        if module is body and name:
            return name.split(".")
    return None


class HeadForward:
    """The causal LM's forward from its body's last hidden states to its logits: shallow copies of the modules
    from the causal LM down to the body's parent, the body replaced by `_Given` (the same head modules, hooks
    and config)."""

    def __init__(self, hf: Any):
        path = body_path(hf)
        if path is None:
            raise ValueError(f"{type(hf).__name__}: its body is not inside the causal LM")
        self.given = _Given(body_of(hf))
        self.view = copy.copy(hf)
        parent = self.view
        for name in path[:-1]:
            child = copy.copy(parent._modules[name])
            parent._modules = {**parent._modules, name: child}
            parent = child
        parent._modules = {**parent._modules, path[-1]: self.given}

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.given.hidden = hidden
        try:
            ids = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
            return self.view(input_ids=ids, use_cache=False).logits
        finally:
            self.given.hidden = None


@dataclass(frozen=True)
class HeadForm:
    plain: bool
    """The logits are hidden @ W_out.T: the fused, chunked loss computes them."""
    why: str = ""
    """What the head does beyond that (the aten ops), when not plain."""


_SAME = {"alias", "detach", "clone", "contiguous", "view", "_unsafe_view", "reshape", "slice", "lift_fresh"}
"""Ops that keep a tensor's values in order when they keep its element count (a full slice, a reshape)."""


class _Follow(TorchDispatchMode):
    """Labels every tensor made from the hidden states `h` and the weight `W` (vocab x d) by what it holds: "h" (h
    reshaped), "W", "Wt" (W transposed), "logits" (h @ W.T reshaped); any other op's result is unlabelled."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor):
        super().__init__()
        self.labels: dict[int, str] = {id(hidden): "h", id(weight): "W"}
        self.kept: list[torch.Tensor] = [hidden, weight]  # alive, so that no id is reused
        self.others: list[str] = []
        self.d, self.vocab = weight.shape[1], weight.shape[0]

    def label(self, t: object) -> str | None:
        return self.labels.get(id(t)) if isinstance(t, torch.Tensor) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        inputs = [self.label(a) for a in args]
        if func._schema.is_mutable:  # an in-place op changes what its written argument holds
            for arg, a in zip(func._schema.arguments, args, strict=False):
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.Tensor):
                    self.labels.pop(id(a), None)
        made = self._made(name, inputs, args, out)
        if made is not None and isinstance(out, torch.Tensor):
            self.labels[id(out)] = made
            self.kept.append(out)
        elif any(inputs):
            self.others.append(f"aten.{name}")
        return out

    def _made(self, name: str, inputs: list[str | None], args: tuple, out: object) -> str | None:
        if not isinstance(out, torch.Tensor) or not inputs or inputs[0] is None:
            return None
        first, src = inputs[0], args[0]
        if name in _SAME and out.numel() == src.numel() and out.shape[-1:] == src.shape[-1:]:
            return first
        if name == "_to_copy" and out.dtype == torch.float32 and out.shape == src.shape:
            return first
        if name in ("t", "transpose") and first in ("W", "Wt") and out.dim() == 2:
            return "Wt" if first == "W" else "W"
        if name in ("mm", "bmm", "matmul") and first == "h" and inputs[1] == "Wt" and src.shape[-1] == self.d:
            return "logits"
        return None


def head_form(hf: Any) -> HeadForm:
    """Whether the model's logits are plain `hidden @ W_out.T` (see the module's docstring); on the meta device."""
    weight = hf.get_output_embeddings().weight
    if not weight.is_meta or weight.dim() != 2:
        raise ValueError("head_form proves the head's form on a model built on the meta device")
    head = HeadForward(hf)
    width = getattr(hf.config.get_text_config(), "hidden_size", None) or weight.shape[1]  # the body's output
    hidden = torch.empty(2, 3, width, device="meta")
    follow = _Follow(hidden, weight)
    with torch.no_grad(), follow:
        logits = head(hidden)
    if follow.labels.get(id(logits)) == "logits" and logits.shape == (2, 3, weight.shape[0]) and not follow.others:
        return HeadForm(True)
    beyond = sorted(set(follow.others)) or ["ops that do not reach the logits as hidden @ W_out.T"]
    return HeadForm(False, f"its head computes more than hidden @ W_out.T: {', '.join(beyond)}")
