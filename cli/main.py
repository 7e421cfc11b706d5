"""The `trainyard` command line: serve the API, and submit, plan, follow and control jobs over REST.

Client commands find the server and its token in the state directory that `serve` wrote
(`--state-dir`, default ~/.trainyard), or take `--url` / `--token` (or TRAINYARD_URL / TRAINYARD_TOKEN).
`plan` needs no server: it validates the file and prints the plan locally; `token` makes the service's users on the
state directory. `logs` reads the ranks' logs
(which the service reads from Ray) and `logs --follow` polls them; `metrics --plot` draws the rows with
matplotlib (`cli.plot`).

This module is the command table (one parser for every subcommand); the commands live in `cli.offline` (no
server needed), `cli.tokens` (users), `cli.jobs` (over the API) and `cli.generate` (a job's model sampled here).
"""

from __future__ import annotations

import argparse
import os
import sys

# Ray's token auth for the cluster `serve` embeds, set before anything here imports Ray (the command table's
# modules do, through the store): Ray reads RAY_AUTH_MODE once, as it is imported, and a driver imported before it
# is set talks without the token to daemons started with it (every call refused: `trainyard serve` exited 1).
# Test fixtures alone set it to disabled; commands other than `serve` start no Ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")

from trainyard.cli import generate, jobs, offline, tokens  # noqa: E402 - after the line above
from trainyard.cli.client import ApiError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_attach_values(sys.argv[1:] if argv is None else argv, ("--token",)))
    try:
        return args.func(args)
    except ApiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the command reads or writes: a spec that is not there, an export's -o
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainyard", description="Train GPT models on a Ray cluster.")
    p.add_argument("--state-dir", default=os.environ.get("TRAINYARD_STATE_DIR"),
                   help="state directory (default ~/.trainyard)")
    p.add_argument("--url", default=os.environ.get("TRAINYARD_URL"), help="API address (default: from state dir)")
    p.add_argument("--token", default=os.environ.get("TRAINYARD_TOKEN"), help="API token (default: from state dir)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start the API (and an embedded Ray unless --ray-address)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    s.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of embedded Ray (default max(cores, 8))")
    s.add_argument("--allow-fault-injection", action="store_true",
                   help="accept fault drills (POST /api/jobs/{id}/faults: kill or hang a rank); off by default")
    s.add_argument("--max-queued", type=int, default=1000,
                   help="most jobs waiting in the queue; a submit beyond it is refused (429)")
    s.add_argument("--max-upload-bytes", type=tokens.parse_size, default=None, metavar="SIZE",
                   help="largest one upload may be, e.g. 16G (default 16G; a user's --max-storage may leave less)")
    s.add_argument("--mlflow-uri", default=None, metavar="URI",
                   help="the MLflow tracking server jobs log to (default: a file store in each job's directory); "
                        "users cannot name another")
    s.add_argument("--wandb-project", default=None, metavar="P", help="the W&B project jobs log to (default trainyard)")
    s.add_argument("--wandb-entity", default=None, metavar="E", help="the W&B entity (default: the key's own)")
    s.add_argument("--base-model", action="append", default=[], type=offline.base_model, metavar="NAME=DIR",
                   help="a Hugging Face directory every user's Tinker training client may name as base_model NAME "
                        "(repeatable; else a client names a directory under its user's data roots)")
    s.set_defaults(func=offline.serve)

    s = sub.add_parser("submit", help="submit a JobSpec file (YAML or JSON)")
    s.add_argument("file")
    s.add_argument("--follow", action="store_true", help="show a progress bar until the job ends")
    s.set_defaults(func=jobs.submit)

    s = sub.add_parser("plan", help="validate a JobSpec and show its plan (no server needed)")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.add_argument("--costs", metavar="F,B[,C]", type=offline.parse_costs,
                   help="simulate the schedule with these per-chunk forward, backward (and communication) costs "
                        "instead of the spec's sim_costs (default 1,2,0)")
    s.add_argument("--auto", action="store_true",
                   help="let the planner choose the layout (as `parallel: auto` does) and show its top five; the "
                        "spec's other parallel options (grad_compression, reduce_dtype, sync) are kept")
    s.add_argument("--nodes", type=int, default=0,
                   help="plan for this many nodes like the options below (default: this machine)")
    s.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs a node holds: each rank gets one, costed with --device's profile, and the output "
                        "predicts the step (tokens/s per device, MFU, HFU, memory, where the time goes)")
    s.add_argument("--device", default=None, metavar="NAME",
                   help="the GPU's profile: a100-80gb, h100-sxm, h100-96gb-500w, h200 (parallel/plan/planner/"
                        "devices/), or a profile file's path (default with --gpus-per-node: h100-sxm)")
    s.add_argument("--gpu-memory-gib", type=float, default=0.0,
                   help="with --gpus-per-node: each GPU's memory, instead of the device profile's")
    s.add_argument("--cpus-per-node", type=float, default=0,
                   help="default: 8 per GPU with --gpus-per-node, else this machine's")
    s.set_defaults(func=offline.plan)

    for name, func, text in (("status", jobs.status, "show a job"), ("follow", jobs.follow_job, "follow a job"),
                             ("stop", jobs.stop, "stop a job"), ("delete", jobs.delete, "delete a finished job")):
        s = sub.add_parser(name, help=text)
        s.add_argument("job_id")
        s.set_defaults(func=func)
    s = sub.add_parser("upload", help="upload a file or a prepared dataset directory; prints the path a spec names")
    s.add_argument("path")
    s.add_argument("--name", default=None, help="its name in the upload (default: the file's or directory's)")
    s.set_defaults(func=jobs.upload)
    s = sub.add_parser("files", help="your uploads: list them, or `files rm ID`")
    files = s.add_subparsers(dest="files_command")
    files.add_parser("ls", help="list your uploads (the default)")
    rm = files.add_parser("rm", help="delete one of your uploads")
    rm.add_argument("upload_id")
    s.add_argument("--json", action="store_true", help="the list as JSON")
    s.set_defaults(func=jobs.files)
    s = sub.add_parser("metrics", help="print a job's per-step metrics")
    s.add_argument("job_id")
    s.add_argument("--since", type=int, default=0)
    s.add_argument("--plot", metavar="FILE.png", help="draw loss, tokens/s (and a pipeline's bubble) into a PNG")
    s.set_defaults(func=jobs.metrics)
    s = sub.add_parser("tensorboard", help="print a job's TensorBoard logdir (`tensorboard --logdir $(trainyard "
                       "tensorboard ID)`)")
    s.add_argument("job_id")
    s.set_defaults(func=jobs.tensorboard)
    s = sub.add_parser("scale", help="resize a running job's data parallelism (at its next step)")
    s.add_argument("job_id")
    s.add_argument("--dp", type=int, required=True, help="the new number of data-parallel replicas")
    s.set_defaults(func=jobs.scale)
    s = sub.add_parser("events", help="what happened to a job: failures, recoveries (with their time), checkpoints")
    s.add_argument("job_id")
    s.set_defaults(func=jobs.events)
    s = sub.add_parser("export", help="download a finished job's trained model: DIR/model.safetensors and "
                                      "DIR/config.json, a Hugging Face directory (--format hf), or a LoRA job's "
                                      "PEFT adapter (--format peft)")
    s.add_argument("job_id")
    s.add_argument("-o", "--output", required=True, metavar="DIR")
    s.add_argument("--format", choices=("trainyard", "hf", "peft"), default="trainyard",
                   help="trainyard (default): one safetensors file; hf: config.json, safetensors, "
                        "generation_config.json and the tokenizer, for transformers.from_pretrained (a LoRA job: "
                        "the merged model); peft: adapter_config.json and adapter_model.safetensors, for "
                        "peft.PeftModel.from_pretrained")
    s.set_defaults(func=jobs.export)
    generate.add_parser(sub)
    s = sub.add_parser("logs", help="print the ranks' logs (stderr by default), read from Ray")
    s.add_argument("job_id")
    s.add_argument("--rank", type=int, default=None, help="one rank (default: every rank, each line prefixed)")
    s.add_argument("--tail", type=int, default=1000, help="the last N lines of each rank (default 1000)")
    s.add_argument("--stdout", action="store_true", help="the ranks' stdout instead of their stderr")
    s.add_argument("--follow", "-f", action="store_true", help="then print new lines as they come, until the job ends")
    s.set_defaults(func=jobs.logs)
    _add_prepare(sub)
    tokens.add_parser(sub)
    sub.add_parser("list", help="list jobs").set_defaults(func=jobs.list_jobs)
    sub.add_parser("cluster", help="show the Ray cluster").set_defaults(func=jobs.cluster)
    return p


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    from trainyard.parallel.data.prepare import PrepareOptions, default_workers

    s = sub.add_parser("prepare", help="tokenize text, JSONL or Parquet into a dataset directory (no server needed)")
    s.add_argument("inputs", nargs="+", metavar="INPUT", help="text files (a document each), .jsonl, .parquet, or "
                                                                "directories of them")
    s.add_argument("-o", "--output", required=True, metavar="DIR", help="the dataset directory to write")
    s.add_argument("--tokenizer", required=True, metavar="PATH", help="a tokenizer.json or a directory holding one")
    s.add_argument("--field", default=PrepareOptions.field, help="JSONL: the field holding the text (default text)")
    s.add_argument("--column", default=PrepareOptions.column, help="Parquet: the text column (default text)")
    s.add_argument("--chat", action="store_true", help="JSONL of {messages} or {prompt, completion} records; stores "
                                                       "a loss mask (only assistant/completion tokens count)")
    s.add_argument("--eos", default=None, help="the EOS token (default: tokenizer_config.json's eos_token)")
    s.add_argument("--shard-tokens", type=int, default=PrepareOptions.shard_tokens, help="tokens per shard file")
    s.add_argument("--workers", type=int, default=default_workers(),
                   help=f"tokenizing processes (default {default_workers()}, this machine's cores)")
    s.set_defaults(func=offline.prepare)


def _attach_values(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`--token VALUE` as `--token=VALUE`: argparse reads a separate value that starts with '-' as an
    option, and a token may start with '-' (the service never makes one, but a user may bring one)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in options and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out




if __name__ == "__main__":
    sys.exit(main())

