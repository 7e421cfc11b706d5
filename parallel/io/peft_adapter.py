"""PEFT LoRA adapter directories: write a LoRA job's adapters as one, and start a job's adapters from one.

A directory holds `adapter_config.json` (PEFT's `LoraConfig`: r, lora_alpha, lora_dropout, target_modules) and
`adapter_model.safetensors`, whose keys are PEFT's: the Hugging Face module of the base projection under
`base_model.model.`, then `lora_A.weight` / `lora_B.weight` (llama's `blocks.0.attn.q.lora_A.weight` is
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). The base projection's HF name comes from the
family's mapping (`parallel.models.<family>.hf`), so `peft.PeftModel.from_pretrained(base, directory)` puts each
adapter on the projection trainyard trained it on. A projection that is a piece of a fused HF tensor (gpt2's
q, k and v in `c_attn`) has no PEFT adapter of its own: refused with the target to leave out.

Reading (`load_into`) takes each rank's block of each adapter (its tensor-parallel shard), as
`parallel.io.hf_checkpoint` reads a base.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from trainyard.parallel.config import ModelConfig, RuleError
from trainyard.parallel.io.hf_checkpoint import local_block
from trainyard.parallel.io.hf_spec import adapter_for_family
from trainyard.parallel.models.components.lora import adapter_names, is_adapter

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_keys(cfg: ModelConfig, names: Iterable[str], field: str = "model.lora.targets") -> dict[str, str]:
    """Each adapter name -> its PEFT key; RuleError (on `field`) for an adapter whose base is part of a fused HF
    tensor."""
    sources = adapter_for_family(cfg.family).sources(cfg)
    uses = Counter(s.key for s in sources.values())
    keys = {}
    for name in names:
        base, _, kind = name.rpartition(".lora_")
        source = sources[f"{base}.weight"]
        if uses[source.key] > 1 or source.expert is not None:
            raise RuleError(field, f"{base} is a piece of the Hugging Face tensor {source.key}: PEFT has no adapter "
                                   "for it (leave its target out to export one)")
        keys[name] = f"{PREFIX}{source.key.removesuffix('.weight')}.lora_{kind}"
    return keys


def adapter_config(cfg: ModelConfig, keys: Iterable[str], base: str | None) -> dict:
    """PEFT's adapter_config.json for the adapters `keys` (PEFT keys) of `cfg.lora`: `target_modules` are the HF
    modules' own names (q_proj, ...); `fan_in_fan_out` where HF keeps the base transposed (GPT-2's Conv1D)."""
    assert cfg.lora is not None
    modules = sorted({k.removeprefix(PREFIX).rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in keys})
    transposed = {s.key.removesuffix(".weight").rsplit(".", 1)[-1] for s in adapter_for_family(cfg.family)
                  .sources(cfg).values() if s.transpose}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": cfg.lora.rank,
            "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout, "target_modules": modules,
            "bias": "none", "fan_in_fan_out": bool(transposed & set(modules)), "use_rslora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def write_peft_dir(out: Path, cfg: ModelConfig, state: Mapping[str, torch.Tensor], base: str | None = None) -> Path:
    """The adapters of a whole model's `state` (an export's, trainyard names) as a PEFT adapter directory."""
    keys = peft_keys(cfg, [n for n in state if is_adapter(n)])
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(adapter_config(cfg, keys.values(), base), indent=2) + "\n")
    save_file({k: state[n].contiguous() for n, k in keys.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


@torch.no_grad()
def load_into(modules: Iterable[nn.Module], cfg: ModelConfig, directory: Path) -> None:
    """Copy this rank's block of each adapter of `modules` from the PEFT directory `directory`; RuleError naming
    `init_from.adapter` when it is not an adapter of this job's rank, alpha and targets."""
    assert cfg.lora is not None
    directory = Path(directory).expanduser()
    try:
        config = json.loads((directory / CONFIG).read_text())
        f = safe_open(str(directory / WEIGHTS), framework="pt")
    except (OSError, ValueError, SafetensorError) as e:
        raise RuleError("init_from.adapter", f"{directory} is not a PEFT adapter directory: {e}") from None
    if config.get("r") != cfg.lora.rank or float(config.get("lora_alpha", 0)) != cfg.lora.alpha:
        raise RuleError("init_from.adapter", f"{directory} has r={config.get('r')}, lora_alpha="
                                             f"{config.get('lora_alpha')}; model.lora has rank={cfg.lora.rank}, "
                                             f"alpha={cfg.lora.alpha}")
    params = {name: p for module in modules for name, p in module.named_parameters() if is_adapter(name)}
    wanted = peft_keys(cfg, adapter_names(cfg), field="init_from.adapter")
    stored = set(f.keys())
    if stored != set(wanted.values()):
        raise RuleError("init_from.adapter", f"{directory} does not adapt model.lora.targets: missing "
                                             f"{sorted(set(wanted.values()) - stored)[:3]}, unexpected "
                                             f"{sorted(stored - set(wanted.values()))[:3]}")
    keys = {name: wanted[name] for name in params}
    for name, p in params.items():
        block = local_block(p)
        part = f.get_slice(keys[name])[tuple(slice(a, b) for a, b in block)]
        local = p.to_local() if isinstance(p, DTensor) else p
        if part.shape != local.shape:
            raise RuleError("init_from.adapter", f"{directory}: {keys[name]} gives {name} a block of shape "
                                                 f"{tuple(part.shape)}, expected {tuple(local.shape)}")
        local.copy_(part)
