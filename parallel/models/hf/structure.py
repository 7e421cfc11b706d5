"""What the transformers backend knows of a model before any rank builds it: its structure, read from transformers'
own model built on the meta device (no storage: cheap at any size), once per config.json.

`structure(hf_config)` gives every parameter's name and shape, the input embedding's elements, each decoder layer's
elements (`decoder_layers`: ZeRO's units and recompute's), each parameter's names in a checkpoint
(`names.checkpoint_names`), the head's form (`head.head_form`), and `refusals`: why the backend cannot train this
model exactly, each a sentence for a 422 at submit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from trainyard.parallel.models.hf.build import build
from trainyard.parallel.models.hf.head import HeadForm, body_of, body_path, head_form
from trainyard.parallel.models.hf.names import Names, checkpoint_names


@dataclass(frozen=True)
class Structure:
    architecture: str
    shapes: dict[str, tuple[int, ...]]
    """Every parameter (a tied one once, under the name `named_parameters` gives it) -> its shape."""
    embedding: int
    """Elements of the input embedding (`get_input_embeddings()`)."""
    layers: tuple[int, ...]
    """Elements of each decoder layer."""
    names: Names = field(default_factory=Names)
    """Each parameter's names in a checkpoint (`names.checkpoint_names`)."""
    head: HeadForm = HeadForm(False)
    refusals: tuple[str, ...] = ()


def decoder_layers(hf: Any) -> list[Any]:
    """The model's decoder layers, in order: the outermost modules of its body that are transformers'
    `GradientCheckpointingLayer`s (what the architecture checkpoints per layer, and ZeRO-3's units)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    body = body_of(hf)
    layers: dict[str, Any] = {}
    for name, module in body.named_modules() if body is not None else ():
        inside = any(name.startswith(f"{outer}.") for outer in layers)
        if isinstance(module, GradientCheckpointingLayer) and not inside:
            layers[name] = module
    return list(layers.values())


@functools.lru_cache(maxsize=8)
def structure(hf_config: str) -> Structure:
    """The model config.json describes, read on the meta device (raises what transformers raises building it)."""
    with torch.device("meta"):
        hf = build(hf_config, meta=True)
    architecture = type(hf).__name__
    shapes = {name: tuple(p.shape) for name, p in hf.named_parameters()}
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    if embedding is None or head is None or getattr(head, "weight", None) is None:
        return Structure(architecture, shapes, 0, (),
                         refusals=("transformers names no input and output embeddings of it "
                                   "(get_input_embeddings, get_output_embeddings)",))
    layers = tuple(sum(p.numel() for p in m.parameters()) for m in decoder_layers(hf))
    names, names_why = checkpoint_names(hf)
    form, head_why = _head_form(hf)
    refusals = (_own_tensors(hf), _saved_buffers(hf), names_why, head_why, _router_loss(hf))
    return Structure(architecture, shapes, embedding.weight.numel(), layers, names, form,
                     tuple(why for why in refusals if why is not None))


def _head_form(hf: Any) -> tuple[HeadForm, str | None]:
    if body_path(hf) is None:
        return HeadForm(False), "its body is not inside the causal LM, so its head cannot run apart from it"
    try:
        return head_form(hf), None
    except Exception as e:  # noqa: BLE001 - the head's own error, named for the user
        return HeadForm(False), f"its head cannot run apart from its body: {e!r}"


def _own_tensors(hf: Any) -> str | None:
    """The stage holds the causal LM's children, not the causal LM itself."""
    if not (hf._parameters or hf._buffers):
        return None
    own = ", ".join([*hf._parameters, *hf._buffers])
    return f"the causal LM holds tensors of its own ({own}), outside its body and head"


def _saved_buffers(hf: Any) -> str | None:
    """from_pretrained reads a persistent buffer from the checkpoint; the backend computes its buffers."""
    saved = sorted(set(hf.state_dict()) - set(dict(hf.named_parameters(remove_duplicate=False))))
    if not saved:
        return None
    return (f"its checkpoints hold buffers transformers loads with the weights ({saved[0]}, one of {len(saved)}), "
            "which the backend computes as it builds the model instead")


def _router_loss(hf: Any) -> str | None:
    if not getattr(hf.config, "output_router_logits", False):
        return None
    return "output_router_logits is true: transformers adds the router's auxiliary loss, which the backend does not"
