"""`init_from: {hf: DIR}` at submit: the model's architecture read from DIR/config.json into the JobSpec.

Pure JSON (no torch, no tensor read): the service and the CLI's `plan` call `resolve_init_from` on the spec
as submitted, before it is validated. The architecture fields come from config.json through the family's
`config_from_hf` (`parallel/models/<family>/hf.py`, found by the config's `architectures`); the spec's
`model` may leave them out or repeat them, and each one it gives with another value is named in the error,
as `resume_from` does (a value spelled otherwise that means the same, e.g. gpt2's ffn_hidden: 4 x d_model for
n_inner: null, is no other value). Fields config.json does not fix (seq_len, the MoE capacity and loss weights) stay the
spec's. A missing directory or file, an unsupported architecture or a config.json field trainyard cannot
honour is a RuleError naming `init_from.hf` and the config.json field. An architecture no native family lists
goes to the transformers backend (`model.family: hf`, `parallel/models/hf/hf.py`) when transformers'
`AutoModelForCausalLM` builds it: native families claim a directory first; one neither can train is a RuleError
naming it. `init_from_event` is the job's event saying which family claimed the directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from trainyard.parallel.config import JobConfig, NotNative, RuleError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FIELD = "init_from.hf"
BACKEND = "hf"
"""The transformers backend's family: it claims a config.json only when no native family's ARCHITECTURES does."""


def adapter_for_family(family: str) -> ModuleType:
    """The family's HF mapping module, `parallel/models/<family>/hf.py` (see
    `parallel.models.components.hf_mapping.HFAdapter`)."""
    from trainyard.parallel.models import FAMILIES

    return FAMILIES[family].hf


def families() -> list[str]:
    from trainyard.parallel.models import FAMILIES

    return list(FAMILIES)


def adapter_for_architecture(architecture: str) -> ModuleType | None:
    for family in families():
        adapter = adapter_for_family(family)
        if architecture in adapter.ARCHITECTURES:
            return adapter
    return None


def read_hf_config(directory: str | Path) -> dict:
    """DIR/config.json, after checking DIR holds weights too; RuleError(init_from.hf) for what is missing."""
    try:
        path = Path(directory).expanduser()
        is_dir = path.is_dir()
        has_weights = is_dir and ((path / WEIGHTS_FILE).is_file() or (path / INDEX_FILE).is_file())
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, no permission
        raise RuleError(FIELD, f"cannot read {directory!r}: {e}") from None
    if not is_dir:
        raise RuleError(FIELD, f"{path} is not a directory")
    if not has_weights:
        raise RuleError(FIELD, f"{path} holds neither {WEIGHTS_FILE} nor {INDEX_FILE} (safetensors weights)")
    if (path / INDEX_FILE).is_file():  # what the ranks read (parallel.io.hf_checkpoint.HFFiles): every shard it names
        _check_index(path / INDEX_FILE)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise RuleError(FIELD, f"{path} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise RuleError(FIELD, f"{path / CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise RuleError(FIELD, f"{path / CONFIG_FILE} is not a JSON object")
    return config


def _check_index(index: Path) -> None:
    """A sharded checkpoint's index is a JSON object with a weight_map, and every shard file it names is there."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuleError(FIELD, f"{index} is not a safetensors index (a JSON object with a weight_map): {e!r}") from None
    if not isinstance(weight_map, dict):
        raise RuleError(FIELD, f"{index}: weight_map is not a JSON object")
    inside = [isinstance(f, str) and f and not Path(f).is_absolute() and ".." not in Path(f).parts
              for f in weight_map.values()]
    if not all(inside):
        raise RuleError(FIELD, f"{index}: weight_map names a file outside the directory (every shard is one of its "
                               "own)")
    missing = sorted({str(f) for f in weight_map.values() if not (index.parent / f).is_file()})
    if missing:
        raise RuleError(FIELD, f"{index.parent} lacks shard files its {INDEX_FILE} names: {', '.join(missing[:5])}")


def model_fields(directory: str | Path) -> dict:
    """The ModelConfig fields DIR/config.json fixes (the architecture, with `family`): the native family that lists
    its architecture and model_type and implements every field of it; else the transformers backend, when it trains
    the architecture; else a RuleError naming why neither does."""
    config = read_hf_config(directory)
    _refuse_quantized(config)
    native = native_adapter(config)
    not_native: RuleError | None = None
    if native is not None:
        try:
            return _fields(native, config)
        except NotNative as e:  # a field the family does not implement: the backend's to take, if it can
            not_native = e
    backend = adapter_for_family(BACKEND)
    try:
        claimed = backend.claims(config)
    except RuleError as e:
        raise (not_native or RuleError(FIELD, f"{CONFIG_FILE} field {e.field}: {e.message}")) from None
    if claimed:
        return _fields(backend, config)
    if not_native is not None:
        raise not_native
    architectures = config.get("architectures") or []
    supported = sorted(a for f in families() for a in adapter_for_family(f).ARCHITECTURES)
    raise RuleError(FIELD, f"{CONFIG_FILE} field architectures: {architectures} is not supported: no native "
                           f"family reads it (they read {', '.join(supported)}) and it is no "
                           "AutoModelForCausalLM architecture of transformers (model.family hf)")


def native_adapter(config: Mapping) -> ModuleType | None:
    """The native family whose ARCHITECTURES list config.json's one architecture."""
    architectures = config.get("architectures") or []
    return adapter_for_architecture(architectures[0]) if len(architectures) == 1 else None


def native_refusal(config: Mapping) -> str | None:
    """Why the native family that lists config.json's architecture does not claim it (a field it does not
    implement, another model_type); None when it does, or none lists it."""
    native = native_adapter(config)
    if native is None:
        return None
    try:
        _fields(native, config)
    except NotNative as e:
        return e.message
    except RuleError:
        return None
    return None


def _refuse_quantized(config: Mapping) -> None:
    quantized = config.get("quantization_config")
    if quantized:  # its weights are not fp tensors under the usual names
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise RuleError(FIELD, f"{CONFIG_FILE} field quantization_config: a quantized checkpoint ({method}) cannot be "
                               "trained; give its unquantized weights")


def _fields(adapter: ModuleType, config: Mapping) -> dict:
    """The adapter's ModelConfig fields of config.json; its errors named as config.json's (NotNative stays one)."""
    model_types = dict(zip(adapter.ARCHITECTURES, adapter.MODEL_TYPES, strict=True))
    architecture = (config.get("architectures") or [None])[0]
    if architecture in model_types and config.get("model_type") != model_types[architecture]:
        raise NotNative(FIELD, f"{CONFIG_FILE} field model_type: {config.get('model_type')!r}; family "
                               f"{adapter.FAMILY} reads {architecture} of model_type {model_types[architecture]!r}")
    try:
        return adapter.config_from_hf(config)
    except NotNative as e:
        raise NotNative(FIELD, f"{CONFIG_FILE} field {e.field}: {e.message}") from None
    except RuleError as e:
        raise RuleError(FIELD, f"{CONFIG_FILE} field {e.field}: {e.message}") from None
    except (KeyError, TypeError, ValueError, ArithmeticError, AttributeError) as e:  # e.g. num_attention_heads: 0
        raise RuleError(FIELD, f"{CONFIG_FILE} lacks or garbles field {e}") from None


def init_from_event(config: JobConfig, now: float) -> dict | None:
    """The job's `init_from` event: which family claimed `init_from.hf` (a native one, or the transformers backend
    `hf`) for its config.json's architectures, and `not_native`: why the native family that lists the architecture
    left it to the backend; None without init_from.hf. The directory was read at submit; a config.json gone since
    names no architecture."""
    if config.init_from is None or config.init_from.hf is None:
        return None
    try:
        hf = read_hf_config(config.init_from.hf)
    except RuleError:
        hf = {}
    event = {"time": now, "kind": "init_from", "hf": config.init_from.hf, "architectures": hf.get("architectures"),
             "family": config.model.family, "backend": config.model.family == BACKEND}
    why = native_refusal(hf) if config.model.family == BACKEND else None
    return event | ({"not_native": why} if why else {})


def resolve_init_from(spec: Mapping) -> Mapping:
    """The spec with `model`'s architecture filled in from init_from.hf's config.json (the spec unchanged
    without init_from). RuleError naming `model` lists every architecture field the spec gives otherwise."""
    init = spec.get("init_from") if isinstance(spec, Mapping) else None
    if not isinstance(init, Mapping) or not isinstance(init.get("hf"), str):
        return spec  # no init_from, or a malformed one that validation reports
    given = spec.get("model")
    if given is not None and not isinstance(given, Mapping):
        return spec  # a malformed model: validation names it
    given = dict(given or {})
    moe = given.get("moe")
    if moe is not None and not isinstance(moe, Mapping):
        return spec
    fields = model_fields(init["hf"])
    differing = [name for name, value in fields.items() if name != "moe" and name in given and given[name] != value]
    if differing:  # a value spelled otherwise may mean the same: a null ffn_hidden, a rope_scaling's defaults
        mine, theirs = _meaning({**fields, **given}), _meaning({**given, **fields})
        differing = [n for n in differing if mine is None or theirs is None or mine[n] != theirs[n]]
    differences = [f"model.{name}: {given[name]!r} (config.json: {fields[name]!r})" for name in differing]
    if "moe" in fields:
        mine = dict(moe) if isinstance(moe, Mapping) else {}
        differences += [f"model.moe.{k}: {mine[k]!r} (config.json: {v!r})" for k, v in fields["moe"].items()
                        if k in mine and mine[k] != v]
        if "moe" in given and moe is None:
            differences.append(f"model.moe: null (config.json: {fields['moe']!r})")
        fields = {**fields, "moe": {**mine, **fields["moe"]}}
    elif moe is not None:
        differences.append(f"model.moe: {moe!r} (config.json: a dense model)")
    if differences:
        raise RuleError("model", f"differs from {init['hf']}/{CONFIG_FILE} (init_from.hf): "
                                 + "; ".join(differences))
    return {**spec, "model": {**given, **fields}}


def _meaning(model: Mapping) -> dict | None:
    """The dense part of `model` as trainyard reads it: a nested config's left-out keys at their defaults, a null
    ffn_hidden as the family's rule (gpt2's n_inner: null is 4 x d_model), a null head_dim as d_model / n_head.
    None when it is no valid model: validation then names what is wrong."""
    from dataclasses import fields

    from pydantic import TypeAdapter, ValidationError
    from trainyard.parallel.config import ModelConfig
    from trainyard.parallel.models import family_of

    try:
        cfg = TypeAdapter(ModelConfig).validate_python({**model, "moe": None})
    except ValidationError:
        return None
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)} | {"ffn_hidden": family_of(cfg).ffn_hidden(cfg),
                                                                   "head_dim": cfg.head_size}
