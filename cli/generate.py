"""`trainyard generate`: a finished job's trained model samples a prompt, in this process, with the generation the
service's sampling clients run (`parallel.runtime.sampling`: the prompt prefilled, then a KV-cache decode;
temperature, top-k, top-p, seed and stop as Tinker's `SamplingParams` mean them).

The model is the job's Hugging Face export (`GET /api/jobs/{id}/model?format=hf`: a LoRA job's adapters merged,
the tokenizer of its prepared dataset with it), downloaded into a temporary directory, or a directory given with
`--model` (a `trainyard export --format hf`, or any Hugging Face model directory, no server needed), loaded into
trainyard's own model as a rank loads `init_from.hf`. The prompt is text (with the directory's tokenizer) or token
ids (`--tokens`). torch and transformers are imported here only, when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def generate(args: argparse.Namespace) -> int:
    if args.model is None and args.job_id is None:
        print("error: give a finished job's id, or --model DIR", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="trainyard-generate-") as tmp:
        directory = Path(args.model) if args.model is not None else _download(args, Path(tmp))
        return _run(args, directory)


def _download(args: argparse.Namespace, tmp: Path) -> Path:
    import tarfile

    from trainyard.cli.jobs import client_of

    archive = client_of(args).download_model(args.job_id, tmp / "model.tar", format="hf")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "hf", filter="data")
    return tmp / "hf"


def _run(args: argparse.Namespace, directory: Path) -> int:
    import torch
    from trainyard.parallel.config import RuleError
    from trainyard.parallel.io import hf_checkpoint
    from trainyard.parallel.io.hf_spec import resolve_init_from
    from trainyard.parallel.models.whole import full_model
    from trainyard.parallel.runtime.sampling.params import SampleError, has_tokenizer
    from trainyard.parallel.runtime.sampling.sampler import Sampler
    from trainyard.parallel.spec import SpecError, parse_spec

    try:
        model: dict[str, Any] = dict(resolve_init_from({"init_from": {"hf": str(directory)}}).get("model") or {})
        model["seq_len"] = min(int(model.get("context_len") or 4096), 4096)
        cfg = parse_spec({"name": "generate", "model": model, "init_from": {"hf": str(directory)}, "steps": 1}).model
    except (RuleError, SpecError, OSError) as e:
        print(f"error: {directory} is not a model directory trainyard reads ({e})", file=sys.stderr)
        return 2
    tokenizer = None
    if has_tokenizer(directory):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if args.tokens is not None:
        prompt = [int(t) for t in args.tokens.split(",") if t.strip()]
    elif tokenizer is not None:
        prompt = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    else:
        print(f"error: {directory} holds no tokenizer: give the prompt as --tokens ID,ID,...", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stage = full_model(cfg, seed=0)
    hf_checkpoint.load_into([stage], cfg, directory)
    max_tokens = args.max_tokens if args.max_tokens is not None else max(1, min(64, cfg.seq_len - len(prompt)))
    params = {"max_tokens": max_tokens, "temperature": args.temperature, "top_k": args.top_k,
              "top_p": args.top_p, "seed": args.seed}
    if args.stop is not None:
        params["stop"] = [int(s) for s in args.stop] if all(s.isdigit() for s in args.stop) else args.stop
    request = {"prompt": prompt, "num_samples": args.num_samples, "sampling_params": params}
    try:
        out = Sampler(stage.to(device), device, cfg.seq_len, cfg.vocab_size, directory).sample(request)
    except SampleError as e:
        flag = "--" + e.field.rpartition(".")[2].replace("_", "-")
        print(f"error: {flag if flag != '--prompt' or args.tokens is None else '--tokens'}: {e.message}",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"prompt": prompt, "sequences": out["sequences"]}))
        return 0
    for i, s in enumerate(out["sequences"]):
        text = tokenizer.decode(s["tokens"]) if tokenizer is not None else " ".join(map(str, s["tokens"]))
        print(f"[{i}] ({s['stop_reason']}, {len(s['tokens'])} tokens, logprob {sum(s['logprobs']):.3f}) {text}")
    return 0


def add_parser(sub: Any) -> None:
    """The `generate` subcommand in the command table (`cli.main`)."""
    s = sub.add_parser("generate", help="sample a finished job's trained model (or a model directory) on a prompt, "
                                        "here, with the service's generation")
    s.add_argument("job_id", nargs="?", help="a finished job (its Hugging Face export is downloaded)")
    s.add_argument("--model", metavar="DIR", help="a Hugging Face model directory instead (no server needed)")
    s.add_argument("--prompt", default="", help="the prompt's text (read with the model's tokenizer)")
    s.add_argument("--tokens", metavar="ID,ID,...", help="the prompt as token ids instead")
    s.add_argument("--max-tokens", type=int, default=None, help="default: 64, or the rest of the model's context")
    s.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    s.add_argument("--top-k", type=int, default=-1, help="-1 (the default): no limit")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--num-samples", type=int, default=1)
    s.add_argument("--stop", nargs="*", default=None, metavar="STOP",
                   help="stop strings, or token ids (all digits); none given: stop on nothing; default: the EOS")
    s.add_argument("--json", action="store_true", help="the prompt's and each sample's tokens, logprobs and stop "
                                                       "reason as JSON")
    s.set_defaults(func=generate)
