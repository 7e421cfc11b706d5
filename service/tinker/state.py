"""The Tinker-compatible API's saved state: `save_state` writes a training client's adapters and their optimizer
state as a DCP checkpoint, as a job's checkpoints are (every rank its part, rank 0 commits the manifest:
`OpenLoopRank.save_state`), under its owner's folder (`service.tenancy.tinker_paths`, where every run id and
`tinker://` path resolves against its owner); a client takes one back (`load_state`, with or without its optimizer
state) or is made from one (the SDK's `create_training_client_from_state[_with_optimizer]`: a `load_weights` that
names a session), at the layout it asks for, whatever layout wrote it (DCP reshards); the training runs and their
checkpoints are listed and deleted, and a checkpoint's adapters come as a PEFT adapter directory, made as a LoRA
job's are (`parallel.io.export`, `service.hf_export`).

A checkpoint's manifest records, beside what a job's records (`actors.storage.checkpoint_info`), the client's spec
and what its `create_model` asked (base model, LoRA rank, seed, targets), and the save's time, TTL and user
metadata (`tinker`). A checkpoint past its TTL is deleted when next looked at. A save or load is queued on the
client's actor, so it runs after the calls made before it; its future answers as the SDK reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.actors.storage import checkpoint_info
from trainyard.parallel.config import RuleError
from trainyard.parallel.io import checkpoint
from trainyard.parallel.spec import parse_spec, spec_to_dict
from trainyard.service.errors import CheckpointNotFound, JobConflict
from trainyard.service.tenancy.tinker_paths import RUN_FILE, Ref, TinkerPaths, check_name, check_run_id, parse, ref_of
from trainyard.service.tenancy.uploads import tree_bytes
from trainyard.service.tenancy.users import User
from trainyard.service.tinker.specs import client_config

if TYPE_CHECKING:
    from trainyard.service.tinker.clients import Client, TinkerClients

TINKER = "tinker"
"""The manifest's section of what the Tinker API records."""
MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 86400
_export_lock = threading.Lock()


@dataclass(frozen=True)
class Saved:
    """A committed checkpoint: its ref, its directory (`weights/<name>`), the step it holds and its manifest."""

    ref: Ref
    directory: Path
    step: int
    manifest: dict

    @property
    def step_dir(self) -> Path:
        return checkpoint.step_dir(self.directory, self.step)

    @property
    def record(self) -> dict:
        return self.manifest.get(TINKER) or {}


class TinkerState:
    """The saved state of `clients`' users (`clients.tenancy.tinker`: where it lives)."""

    def __init__(self, clients: TinkerClients):
        self.clients = clients

    @property
    def paths(self) -> TinkerPaths:
        return self.clients.tenancy.tinker

    # --- a client's state --------------------------------------------------------------------------------------

    def save(self, user: User, model_id: str, name: str | None, ttl_seconds: int | None = None,
             overwrite: bool = False, user_metadata: dict[str, str] | None = None) -> str:
        """Queue a save of the client's state as checkpoint `name` of its run (a new name when None); the request
        id whose result is its `tinker://` path. RuleError naming `path` or `ttl_seconds`."""
        name = check_name(name if name is not None else f"state-{uuid.uuid4().hex[:8]}", "path")
        if ttl_seconds is not None and not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
            raise RuleError("ttl_seconds", "1 hour (3600) to 10 years, or none (never expires)")
        client = self._client(user, model_id)
        ref = Ref(check_run_id(model_id, "model_id"), "weights", name)
        if not overwrite and self._saved(user, ref) is not None:
            raise RuleError("path", "this training run has a checkpoint of this name (overwrite replaces it)")
        try:
            self.clients.tenancy.check_storage(user)
        except JobConflict as e:  # a 409 the SDK would retry for minutes: the caller's to fix, a 422
            raise RuleError("path", str(e)) from None
        now = time.time()
        info = {**checkpoint_info(client.config), "spec": spec_to_dict(client.config),
                TINKER: {**_created_from(client), "run_id": model_id, "name": name, "time": now,
                         "expires_at": None if ttl_seconds is None else now + ttl_seconds,
                         "user_metadata": dict(user_metadata) if user_metadata else None}}
        self._write_run(user, model_id, client, now)
        directory = self.paths.checkpoint_dir(user.name, ref)
        with self.clients._lock:
            live = self.clients._client(user, model_id)
            call = self.clients.submit(live, "save_state", str(directory), info,
                                     {"path": ref.tinker_path, "type": "save_weights"})
            return self.clients._future(user, call, model_id)

    def load(self, user: User, model_id: str, path: str, optimizer: bool) -> str:
        """Queue a load of checkpoint `path` into the live client `model_id` (the SDK's deprecated `load_state*`);
        the request id. CheckpointNotFound / RuleError naming `path`."""
        saved = self._intact(user, parse(path, "path"), "path")
        client = self._client(user, model_id)
        _check_fits(saved, client.config)
        return self._queue_load(user, model_id, saved, path, optimizer)

    def create_from(self, user: User, session_id: str, model_seq_id: int, path: str, optimizer: bool,
                    base_model: str | None = None, parallel: dict | None = None) -> tuple[str, str]:
        """A new training client of `session_id` made from checkpoint `path` (its base model, unless `base_model`
        names a compatible one; its LoRA rank, seed and targets) at the layout `parallel`, with the checkpoint's
        optimizer state when `optimizer`: (its model id, the SDK's `<session>:train:<seq>`, and the request id
        whose result says it is loaded)."""
        saved = self._intact(user, parse(path, "path"), "path")
        made = saved.record
        if "lora_rank" not in made:
            raise RuleError("path", "not a checkpoint of a training client")
        base = base_model or made["base_model"]
        targets = tuple(made["targets"]) if made.get("targets") else None
        config = client_config(self.clients.tenancy, user, base, made["lora_rank"], self.clients.registered,
                               made.get("seed", 0), targets, parallel)
        _check_fits(saved, config, field="base_model" if base_model else "path")
        model_id, _ = self.clients.create_model(user, session_id, base, made["lora_rank"], seed=made.get("seed", 0),
                                                targets=targets, parallel=parallel,
                                                model_id=f"{session_id}:train:{model_seq_id}")
        return model_id, self._queue_load(user, model_id, saved, path, optimizer)

    # --- what a user has saved ---------------------------------------------------------------------------------

    def runs(self, user: User, limit: int, offset: int) -> dict[str, Any]:
        """The user's training runs (live clients and runs that saved state), the latest first, a page of them."""
        with self.clients._lock:
            live = [mid for mid, c in self.clients.clients.items() if c.owner == user.name]
        runs = [self._run(user, run_id) for run_id in sorted(set(self.paths.runs(user.name)) | set(live))]
        runs.sort(key=lambda r: r["last_request_time"], reverse=True)
        return {"training_runs": runs[offset:offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    def run(self, user: User, run_id: str) -> dict[str, Any]:
        check_run_id(run_id, "training_run_id")
        return self._run(user, run_id)

    def checkpoints(self, user: User, run_id: str) -> dict[str, Any]:
        self.run(user, run_id)  # the run's, or missing
        return {"checkpoints": [_listed(s) for s in self._all_saved(user, run_id)], "cursor": None}

    def user_checkpoints(self, user: User, limit: int, offset: int) -> dict[str, Any]:
        saved = [s for run_id in self.paths.runs(user.name) for s in self._all_saved(user, run_id)]
        saved.sort(key=lambda s: s.record.get("time", 0.0), reverse=True)
        return {"checkpoints": [_listed(s) for s in saved[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(saved)}}

    def weights_info(self, user: User, path: str) -> dict[str, Any]:
        made = self._intact(user, parse(path, "tinker_path"), "tinker_path").record
        attn, mlp, unembed = made.get("targets") or (True, True, False)
        return {"base_model": made.get("base_model"), "is_lora": made.get("lora_rank") is not None,
                "lora_rank": made.get("lora_rank"),
                "train_attn": attn, "train_mlp": mlp, "train_unembed": unembed}

    def delete(self, user: User, run_id: str, checkpoint_id: str) -> None:
        ref = ref_of(run_id, checkpoint_id, "checkpoint_id")
        shutil.rmtree(self.paths.existing(user.name, ref, "checkpoint_id"))

    def peft_archive(self, user: User, run_id: str, checkpoint_id: str) -> Path:
        """A tar of the checkpoint's adapters as a PEFT adapter directory for its base model, or of a full
        fine-tuning's whole model as a Hugging Face directory (made once, beside it: the job's export,
        `export_model` then `hf_export.hf_archive`); RuleError on `model.lora` for an adapter PEFT has no form
        for."""
        saved = self._intact(user, ref_of(run_id, checkpoint_id, "checkpoint_id"), "checkpoint_id")
        from trainyard.parallel.io.export import export_model  # torch: only when asked for
        from trainyard.service.hf_export import hf_archive

        model_file = saved.directory / "export" / checkpoint.MODEL_FILE
        with _export_lock:
            manifest = saved.step_dir / checkpoint.MANIFEST
            if not model_file.is_file() or model_file.stat().st_mtime < manifest.stat().st_mtime:
                export_model(parse_spec(saved.manifest["spec"]), saved.step_dir, saved.step, model_file)
            lora = (saved.manifest["spec"].get("model") or {}).get("lora")
            return hf_archive(model_file, saved.manifest["spec"], "peft" if lora else "hf")

    # --- helpers -----------------------------------------------------------------------------------------------

    def _client(self, user: User, model_id: str) -> Client:
        with self.clients._lock:
            return self.clients._client(user, model_id)

    def _queue_load(self, user: User, model_id: str, saved: Saved, path: str, optimizer: bool) -> str:
        answer = {"path": path, "model_id": model_id, "type": "load_weights"}
        with self.clients._lock:
            client = self.clients._client(user, model_id)
            call = self.clients.submit(client, "load_state", str(saved.step_dir), saved.step, optimizer, answer)
            return self.clients._future(user, call, model_id)

    def _saved(self, user: User, ref: Ref) -> Saved | None:
        """`user`'s committed checkpoint `ref`, or None (none, or past its TTL: then deleted)."""
        directory = self.paths.checkpoint_dir(user.name, ref)
        steps = checkpoint.committed_steps(directory)
        if not steps:
            return None
        try:
            manifest = checkpoint.read_manifest(checkpoint.step_dir(directory, steps[-1]))
        except (OSError, ValueError):
            manifest = {}
        expires = (manifest.get(TINKER) or {}).get("expires_at")
        if expires is not None and expires < time.time():
            shutil.rmtree(directory, ignore_errors=True)
            return None
        return Saved(ref, directory, steps[-1], manifest)

    def _intact(self, user: User, ref: Ref, field: str) -> Saved:
        """`user`'s checkpoint `ref`, its files as its manifest says; CheckpointNotFound / RuleError naming `field`."""
        saved = self._saved(user, ref)
        if saved is None:
            raise CheckpointNotFound(field)
        if checkpoint.verify(saved.step_dir) is not None:
            raise RuleError(field, "the checkpoint is damaged (its files do not match its manifest)")
        return saved

    def _all_saved(self, user: User, run_id: str) -> list[Saved]:
        return [s for ref in self.paths.checkpoints(user.name, run_id) if (s := self._saved(user, ref)) is not None]

    def _run(self, user: User, run_id: str) -> dict[str, Any]:
        with self.clients._lock:
            client = self.clients.clients.get(run_id)
            client = client if client is not None and client.owner == user.name else None
        record_file = self.paths.run_dir(user.name, run_id) / RUN_FILE
        if client is None and not record_file.is_file():
            raise CheckpointNotFound("training_run_id")
        record = json.loads(record_file.read_text()) if record_file.is_file() else {}
        saved = self._all_saved(user, run_id)
        last = max(saved, key=lambda s: s.record.get("time", 0.0), default=None)
        latest = time.time() if client is not None else max(
            [record.get("created", 0.0), *(s.record.get("time", 0.0) for s in saved)])
        rank = client.lora_rank if client is not None else record.get("lora_rank")
        return {"training_run_id": run_id, "model_owner": user.name, "is_lora": rank is not None, "corrupted": False,
                "base_model": client.base_model if client is not None else record.get("base_model"),
                "lora_rank": rank,
                "last_request_time": _iso(latest), "last_checkpoint": None if last is None else _listed(last),
                "last_sampler_checkpoint": None, "user_metadata": None}

    def _write_run(self, user: User, run_id: str, client: Client, now: float) -> None:
        """The run's record, written at its first save (atomically: a record is whole or absent)."""
        record_file = self.paths.run_dir(user.name, run_id) / RUN_FILE
        if record_file.is_file():
            return
        record_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = record_file.with_name(f".{RUN_FILE}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps({"training_run_id": run_id, "created": now, **_created_from(client)}))
        os.replace(tmp, record_file)


def _created_from(client: Client) -> dict[str, Any]:
    targets = client.args.get("targets")
    return {"base_model": client.base_model, "lora_rank": client.lora_rank, "seed": client.args.get("seed", 0),
            "targets": list(targets) if targets is not None else None}


def _check_fits(saved: Saved, config: Any, field: str = "path") -> None:
    """The checkpoint holds adapters of this client's model: the same base, LoRA rank and targets (its context
    length may differ)."""
    theirs = {k: v for k, v in (saved.manifest.get("model") or {}).items() if k != "seq_len"}
    mine = {k: v for k, v in spec_to_dict(config)["model"].items() if k != "seq_len"}
    if theirs != mine:
        raise RuleError(field, "the checkpoint holds adapters of another model (its base model, LoRA rank and "
                               "targets must be this client's)")


def _listed(saved: Saved) -> dict[str, Any]:
    """A checkpoint as the SDK's `Checkpoint` reads it."""
    made = saved.record
    return {"checkpoint_id": saved.ref.checkpoint_id, "checkpoint_type": saved.ref.checkpoint_type,
            "training_run_id": saved.ref.run_id, "tinker_path": saved.ref.tinker_path,
            "time": _iso(made.get("time", 0.0)), "size_bytes": tree_bytes(saved.step_dir), "public": False,
            "user_metadata": made.get("user_metadata"),
            "expires_at": None if made.get("expires_at") is None else _iso(made["expires_at"])}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat()
