"""Hugging Face checkpoint directories: read one into a rank's model chunks, slice by slice, and write one.

Reading (`load_into`): a directory holds config.json and `model.safetensors`, or shards named by
`model.safetensors.index.json`. Each rank opens only the files holding its tensors and reads, with
safetensors' lazy `get_slice`, only the block of each tensor it holds: for a tensor-parallel DTensor, its
local shard's block (from the DTensor's placements), carried through the family's `Source` onto the HF
tensor (a sub-block of a fused c_attn, transposed for a Conv1D), so no process holds a whole checkpoint.

Writing (`write_hf_dir`): config.json (the family's `config_to_hf`), the tensors in safetensors files of at
most `max_shard_bytes` each (one `model.safetensors` when it fits, else shards and an index, as
`save_pretrained` names them), generation_config.json, and the tokenizer of a prepared dataset directory
(tokenizer.json, tokenizer_config.json) when the job trained on one.

Which family reads an architecture: each family folder's `hf.py` (`parallel/models/<family>/hf.py`) lists
its `ARCHITECTURES`; a new family is found by its folder alone.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from trainyard.parallel.config import ModelConfig, RuleError
from trainyard.parallel.io.hf_spec import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, adapter_for_family
from trainyard.parallel.models.components.hf_mapping import Block, from_hf_block, hf_block, to_hf, whole
from trainyard.parallel.models.components.lora import is_adapter

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
"""save_pretrained's default shard size."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MANIFEST = "manifest.json"
TIED_HEAD = "lm_head.weight"
"""The head's name in every family's HF checkpoint; with tie_word_embeddings a file may hold it too."""


class HFFiles:
    """The safetensors files of an HF directory, opened lazily, and a log of every block read from them."""

    def __init__(self, directory: Path):
        self.directory = Path(directory).expanduser()  # as the submit read it (parallel.io.hf_spec.read_hf_config)
        self._open: dict[str, object] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            self.file_of = dict(json.loads(index.read_text())["weight_map"])
        else:
            self.file_of = dict.fromkeys(self._opened(WEIGHTS_FILE).keys(), WEIGHTS_FILE)
        self.reads: list[tuple[str, Block]] = []
        """(HF name, block) of every read, in order."""

    def read(self, key: str, block: Block) -> torch.Tensor:
        self.reads.append((key, block))
        return self._file(key).get_slice(key)[tuple(slice(a, b) for a, b in block)]

    def shape(self, key: str) -> tuple[int, ...]:
        """The HF tensor's whole shape (from the file's header; no tensor is read)."""
        try:
            return tuple(self._file(key).get_slice(key).get_shape())
        except SafetensorError as e:  # the index names a file that does not hold the tensor
            raise RuleError("init_from.hf", f"{self.directory / self.file_of[key]}: {e}") from None

    def _file(self, key: str):
        return self._opened(self.file_of[key])

    def _opened(self, name: str):
        """A safetensors file, opened once; RuleError naming it when it is missing, truncated or garbled."""
        if name not in self._open:
            try:
                self._open[name] = safe_open(self.directory / name, framework="pt")
            except (SafetensorError, OSError) as e:
                raise RuleError("init_from.hf", f"{self.directory / name} is not a readable safetensors file: "
                                                f"{e}") from None
        return self._open[name]


def local_block(p: torch.Tensor) -> Block:
    """The block of the whole tensor this rank holds: a DTensor's local shard, else everything."""
    if not isinstance(p, DTensor):
        return whole(p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple((o, o + n) for o, n in zip(offset, shape, strict=True))


@torch.no_grad()
def load_into(modules: Iterable[nn.Module], cfg: ModelConfig, directory: Path) -> HFFiles:
    """Copy each parameter of `modules` (this rank's chunks, possibly tensor-parallel) from the HF checkpoint in
    `directory`, reading only this rank's blocks. Returns the files, whose `reads` log what was read."""
    files = HFFiles(directory)
    adapter = adapter_for_family(cfg.family)
    sources = adapter.sources(cfg, files.file_of.keys())
    _check_names(adapter, cfg, sources, files, directory)
    _check_shapes(modules, cfg, sources, files, directory)
    for module in modules:
        for name, p in module.named_parameters():
            if is_adapter(name):  # LoRA's adapters are no part of the base (`parallel.io.peft_adapter` reads them)
                continue
            source = sources[name]
            block = local_block(p)
            part = from_hf_block(source, files.read(source.key, hf_block(source, block)))
            local = p.to_local() if isinstance(p, DTensor) else p
            if part.shape != local.shape:
                raise RuleError("init_from.hf", f"{directory}: {source.key} gives {name} a block of shape "
                                                f"{tuple(part.shape)}, expected {tuple(local.shape)}")
            local.copy_(part)
    return files


def _check_names(adapter, cfg: ModelConfig, sources: Mapping, files: HFFiles, directory: Path) -> None:
    """Every tensor the model needs is there, and every tensor there is used (or a known non-parameter, or the
    stored head of a tied model, which transformers drops for the embedding as trainyard does: a family's
    `tied_keys(cfg)` where it has one, else `lm_head.weight`)."""
    wanted = {s.key for s in sources.values()}
    missing = sorted(wanted - files.file_of.keys())
    tied = adapter.tied_keys(cfg) if hasattr(adapter, "tied_keys") else {TIED_HEAD} if cfg.tie_embeddings else set()
    unused = sorted(k for k in files.file_of.keys() - wanted if not adapter.ignored(k) and k not in tied)
    if missing or unused:
        raise RuleError("init_from.hf", f"{directory} does not match its config.json: missing tensors "
                                        f"{missing[:5]}, unexpected tensors {unused[:5]}")


def _check_shapes(modules: Iterable[nn.Module], cfg: ModelConfig, sources: Mapping, files: HFFiles,
                  directory: Path) -> None:
    """Each HF tensor this rank reads has the whole shape its config.json implies. A rank reads only its own
    blocks, so a tensor larger than that (a vocab_size or intermediate_size in config.json smaller than the
    weights) would otherwise be read in part, silently: a wrong model rather than transformers' size mismatch."""
    expected: dict[str, list[int]] = {}
    for module in modules:
        for name, p in module.named_parameters():  # a DTensor's shape is the whole tensor's
            if is_adapter(name):
                continue
            source = sources[name]
            stops = [stop for _, stop in hf_block(source, whole(p.shape))]
            if source.expert is not None:
                stops[0] = cfg.experts
            known = expected.setdefault(source.key, stops)  # the pieces of a fused tensor: the furthest stop
            expected[source.key] = [max(a, b) for a, b in zip(known, stops, strict=True)]
    for key, shape in expected.items():
        if list(files.shape(key)) != shape:
            raise RuleError("init_from.hf", f"{directory}: {key} has shape {files.shape(key)}, its config.json "
                                            f"implies {tuple(shape)}")


def write_hf_dir(out: Path, cfg: ModelConfig, state: Mapping[str, torch.Tensor], *,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer_from: Path | None = None) -> Path:
    """Write the whole model `state` (trainyard names, e.g. an export's safetensors file) as an HF directory
    `out`: written under a temporary name and renamed, so `out` appears complete or not at all."""
    adapter = adapter_for_family(cfg.family)
    hf_config = adapter.config_to_hf(cfg)
    if cfg.hf_config is None:  # a native family's: no token ids unless a tokenizer says (the backend keeps its own)
        hf_config |= {"bos_token_id": None, "eos_token_id": None}
    tensors = to_hf(state, adapter.sources(cfg))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    eos = _copy_tokenizer(tokenizer_from, tmp) if tokenizer_from is not None else None
    if eos is not None:
        hf_config |= {"eos_token_id": eos, "bos_token_id": eos}
    (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"_from_model_config": True} | ({"eos_token_id": eos, "bos_token_id": eos} if eos is not None else {})
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_tensors(tmp, tensors, max_shard_bytes)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _write_tensors(directory: Path, tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2) + "\n")


def _copy_tokenizer(source: Path, out: Path) -> int | None:
    """The tokenizer files of a prepared dataset directory (one holding manifest.json) into `out`; returns its
    EOS id, or None when `source` is no such directory."""
    source = Path(source)
    if not (source / MANIFEST).is_file() or not (source / TOKENIZER_FILES[0]).is_file():
        return None
    manifest = json.loads((source / MANIFEST).read_text())
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    if not (out / TOKENIZER_FILES[1]).is_file():
        eos = (manifest.get("tokenizer") or {}).get("eos_token")
        config = {"tokenizer_class": "PreTrainedTokenizerFast"} | ({"eos_token": eos} if eos else {})
        (out / TOKENIZER_FILES[1]).write_text(json.dumps(config, indent=2) + "\n")
    return manifest.get("eos_id")

