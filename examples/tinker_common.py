"""What the Tinker examples share: the service's address and key on the command line, and the SDK's client. The
SDK has no unload: a client is released a minute after its program's heartbeats stop (when the example exits)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def service_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the trainyard service")
    parser.add_argument("--token", default=None,
                        help="your trainyard token (default: $TRAINYARD_TOKEN, else ~/.trainyard/token)")
    parser.add_argument("--base-model", required=True,
                        help="a Hugging Face directory under your data roots, or a name `trainyard serve "
                             "--base-model NAME=DIR` gave one")
    parser.add_argument("--parallel", type=json.loads, default=None, help="the layout, a JobSpec's parallel (JSON)")
    return parser


def api_key(token: str | None) -> str:
    """The SDK's key for a trainyard token (the SDK takes keys with Tinker's prefix only)."""
    token = token or os.environ.get("TRAINYARD_TOKEN") or (Path.home() / ".trainyard" / "token").read_text().strip()
    return "tml-" + token


def training_client(url: str, key: str, base_model: str, rank: int, parallel: dict | None):
    """A LoRA training client of `base_model` at the layout `parallel` (None: one rank)."""
    import tinker

    service = tinker.ServiceClient(base_url=url, api_key=key)
    metadata = {"trainyard_parallel": json.dumps(parallel)} if parallel else None
    return service.create_lora_training_client(base_model=base_model, rank=rank, user_metadata=metadata).result()
