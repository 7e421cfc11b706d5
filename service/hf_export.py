"""A job's trained model as a Hugging Face directory, packed as one tar for `GET /api/jobs/{id}/model?format=hf`
(and a LoRA job's adapters as a PEFT adapter directory, `format=peft`).

Converted from the consolidated safetensors file the job's end wrote (`parallel.io.export.export_hf`), once,
beside it (`hf/` and `hf.tar`); a later request serves the same tar. The tokenizer of the job's prepared
dataset directory (`data.path`, or a mixture's first source, holding a manifest: a mixture's sources share one
tokenizer) goes into the directory with the weights; the path is read as training read it (`~` expanded, a
relative one against the working directory).
"""

from __future__ import annotations

import os
import tarfile
import threading
from pathlib import Path

from trainyard.parallel.data.datasets import resolve_path
from trainyard.parallel.io.export import export_hf, export_peft

_lock = threading.Lock()
ARCHIVE = "hf.tar"


def hf_archive(model_file: Path, spec: dict, format: str = "hf") -> Path:  # noqa: A002 - the query's name
    """The tar of the HF directory (`format` peft: the PEFT adapter directory) of `model_file` (made on first use);
    RuleError when HF (PEFT) has no such model."""
    archive = model_file.parent / f"{format}.tar"
    with _lock:  # two requests at once convert once
        if archive.is_file() and archive.stat().st_mtime >= model_file.stat().st_mtime:
            return archive
        directory = (export_peft(model_file, model_file.parent / "peft") if format == "peft"
                     else _hf_directory(model_file, spec))
        tmp = archive.with_name(archive.name + ".tmp")
        with tarfile.open(tmp, "w") as tar:
            for path in sorted(directory.iterdir()):
                tar.add(path, arcname=path.name)
        os.replace(tmp, archive)
        return archive


def hf_directory(model_file: Path, spec: dict) -> Path:
    """The HF directory of `model_file` (made on first use, beside it); RuleError when HF has no such model."""
    with _lock:
        return _hf_directory(model_file, spec)


def _hf_directory(model_file: Path, spec: dict) -> Path:
    directory = model_file.parent / "hf"
    if (directory / "config.json").is_file() and directory.stat().st_mtime >= model_file.stat().st_mtime:
        return directory
    data_path = _prepared_data(spec.get("data") or {})
    return export_hf(model_file, directory, tokenizer_from=resolve_path(data_path) if data_path else None)


def _prepared_data(data: dict) -> str | None:
    """The dataset path whose tokenizer the job trained with: `data.path`, or the first of `data.sources`."""
    sources = data.get("sources") or []
    return data.get("path") or (sources[0]["path"] if sources else None)
