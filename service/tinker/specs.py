"""What a Tinker `create_model` becomes: a JobConfig whose model is the base model's Hugging Face directory
(`init_from.hf`, resolved against the caller as any spec's paths are: `Tenancy.confine`, or a name the operator
registered), LoRA of the asked rank, AdamW, at the layout asked (a JobSpec's `parallel`: data parallelism over
replicas of one rank or one tensor-parallel group so far; default one rank). The open loop reads no dataset: the
config names the synthetic one the trainer opens at its build."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainyard.parallel.config import JobConfig, RuleError
from trainyard.parallel.io.hf_spec import resolve_init_from
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import SpecError, parse_spec
from trainyard.service.tenancy.requests import Tenancy
from trainyard.service.tenancy.users import User

MAX_SEQ_LEN = 4096
"""The longest sequence a client's datum may have (the model's own limit where it is lower)."""
FORWARD_TOKENS = 4096
"""The positions a client's rank runs in one forward (its micro-batch: FORWARD_TOKENS // seq_len sequences, at least
one), which the memory plan counts: a call's datums go through in forwards of that many padded positions."""


def client_config(tenancy: Tenancy, user: User, base_model: str, lora_rank: int | None,
                  registered: Mapping[str, str], seed: int = 0,
                  targets: tuple[bool, bool, bool] | None = None, parallel: Mapping[str, Any] | None = None
                  ) -> JobConfig:
    """The client's JobConfig; RuleError naming `base_model` or `lora_config.rank` when it cannot be one."""
    if lora_rank is not None and not 1 <= lora_rank <= 1024:
        raise RuleError("lora_config.rank", "must be 1 to 1024")
    directory = registered.get(base_model)
    if directory is None:
        try:
            directory = tenancy.confine({"init_from": {"hf": base_model}}, user)["init_from"]["hf"]
        except RuleError as e:
            raise RuleError("base_model", e.message) from None
    try:
        resolved: Any = resolve_init_from({"init_from": {"hf": directory}})
    except RuleError as e:
        raise RuleError("base_model", f"not a Hugging Face model directory this service reads ({e.message})") \
            from None
    except OSError:
        raise RuleError("base_model", "not a Hugging Face model directory you may read") from None
    model = dict(resolved.get("model") or {})
    model["seq_len"] = min(int(model.get("context_len") or MAX_SEQ_LEN), MAX_SEQ_LEN)
    if lora_rank is not None:  # None: full fine-tuning, every weight trained
        model["lora"] = {"rank": lora_rank, "alpha": float(lora_rank)}
        adapted = _targets(str(model.get("family")), targets or (True, True, False))
        if adapted:
            model["lora"]["targets"] = adapted
    spec = {"name": "tinker-client", "seed": seed, "model": model, "init_from": {"hf": directory},
            "data": {"kind": "synthetic"}, "optimizer": {"kind": "adamw", "warmup_steps": 0, "grad_clip": 0.0},
            "steps": 1_000_000, "global_batch": 1}
    rows = max(1, FORWARD_TOKENS // model["seq_len"])
    spec["global_batch"] = rows
    if parallel:
        spec["parallel"] = dict(parallel)
        dp = parallel.get("dp", 1)
        spec["global_batch"] = rows * (dp if isinstance(dp, int) and dp > 0 else 1)
    try:
        config = parse_spec(spec)
    except SpecError as e:
        raise RuleError(e.errors[0][0], e.errors[0][1]) from None
    from trainyard.parallel.runtime.open_loop import LAYOUT_RULE, layout_violation

    field = layout_violation(make_plan(config))
    if field is not None:
        raise RuleError(field, LAYOUT_RULE)
    return config


def _targets(family: str, targets: tuple[bool, bool, bool]) -> list[str] | None:
    """The projections adapted, by the family's names, for Tinker's (train_attn, train_mlp, train_unembed); None:
    the family's default (the head is never adapted yet)."""
    names = {"llama": (["q", "k", "v", "o"], ["gate", "up", "down"]), "gpt2": (["q", "k", "v", "o"], ["fc", "proj"])}
    if family not in names:
        return None
    attn, mlp = names[family]
    chosen = (attn if targets[0] else []) + (mlp if targets[1] else [])
    if not chosen:
        raise RuleError("lora_config", "train_attn and train_mlp are both off: nothing would be trained here")
    return chosen
