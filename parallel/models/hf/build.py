"""The transformers backend's model, built from the job's config.json: `AutoModelForCausalLM.from_config` in fp32,
with the parameters on the meta device when asked (buffers computed on the CPU, as transformers computes them).

Dropout is off, as in every trainyard family (docs/guide.md, "Hugging Face checkpoints"): a config.json field that
names a dropout (or stochastic-depth, layer-drop) probability is built at 0, and every `nn.Dropout` module the model
makes for itself gets p = 0. Training then computes what transformers' eval-mode forward computes.

`model.hf_config` is a JSON object with a `model_type`: the spec checks it as it is read
(`parallel.config.fields.CONFIG_JSON`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from trainyard.parallel.config import ModelConfig

DROPOUT = re.compile(r"(dropout|pdrop|drop_rate|drop_path|layerdrop)", re.IGNORECASE)
"""A config.json field that is a dropout-like probability (training-time noise, off in trainyard)."""


def without_dropout(fields: dict) -> dict:
    """config.json with every dropout-like probability at 0 (nested configs too)."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            value = without_dropout(value)
        elif DROPOUT.search(key) and isinstance(value, float | int) and not isinstance(value, bool) and value > 0:
            value = 0.0
        out[key] = value
    return out


def config_object(fields: dict) -> Any:
    """transformers' config object of a config.json's fields, read as `from_pretrained` reads the file (its
    `{"__float__": "Infinity"}` spelling of a float JSON has not)."""
    from transformers import AutoConfig, PretrainedConfig

    fields = PretrainedConfig._decode_special_floats(dict(fields))
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def hf_config_object(hf_config: str) -> Any:
    """transformers' config object of the job's config.json, dropout off."""
    return config_object(without_dropout(json.loads(hf_config)))


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
    """`AutoModelForCausalLM.from_config` of the job's config.json, in fp32, dropout off; `meta`: parameters on
    meta, buffers computed on the CPU. (Any: a transformers PreTrainedModel, from an optional package.)"""
    assert cfg.hf_config is not None, "the hf family's ModelConfig carries its config.json (hf_config)"
    return build(cfg.hf_config, meta=meta)


def build(hf_config: str, *, meta: bool = False) -> Any:
    from transformers import AutoModelForCausalLM

    config = hf_config_object(hf_config)
    with _parameters_on_meta() if meta else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model
