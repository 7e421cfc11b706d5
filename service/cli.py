"""The `trainyard` command line: serve the API, and submit, plan, follow and control jobs over REST.

Client commands find the server and its token in the state directory that `serve` wrote
(`--state-dir`, default ~/.trainyard), or take `--url` / `--token` (or TRAINYARD_URL / TRAINYARD_TOKEN).
`plan` needs no server: it validates the file and prints the plan locally. `logs` reads the ranks' logs
(which the service reads from Ray) and `logs --follow` polls them; `metrics --plot` draws the rows with
matplotlib (`service.plot`).

Over 400 lines on purpose: one parser for every subcommand, each a short function beside its arguments, so the
whole command line reads in one place; the work behind them lives elsewhere (`parallel.data.prepare`, the client).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from trainyard.parallel.plan.reduction_bytes import format_reduction
from trainyard.parallel.plan.units import format_bytes
from trainyard.service import state_dir as sd
from trainyard.service.client import ApiError, Client

TERMINAL = {"STOPPED", "SUCCEEDED", "FAILED"}
MAX_LOG_TAIL = 100_000
"""The API's bound on lines per rank in one logs answer."""


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
    s.set_defaults(func=_serve)

    s = sub.add_parser("submit", help="submit a JobSpec file (YAML or JSON)")
    s.add_argument("file")
    s.add_argument("--follow", action="store_true", help="show a progress bar until the job ends")
    s.set_defaults(func=_submit)

    s = sub.add_parser("plan", help="validate a JobSpec and show its plan (no server needed)")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.add_argument("--costs", metavar="F,B[,C]", type=_costs,
                   help="simulate the schedule with these per-chunk forward, backward (and communication) costs "
                        "instead of the spec's sim_costs (default 1,2,0)")
    s.add_argument("--auto", action="store_true",
                   help="let the planner choose the layout (as `parallel: auto` does) and show its top five; the "
                        "spec's other parallel options (grad_compression, reduce_dtype, sync) are kept")
    s.add_argument("--nodes", type=int, default=0,
                   help="with --auto: plan for this many nodes like the options below (default: this machine)")
    s.add_argument("--gpus-per-node", type=int, default=0)
    s.add_argument("--gpu-memory-gib", type=float, default=80.0)
    s.add_argument("--cpus-per-node", type=float, default=0,
                   help="default: 8 per GPU with --gpus-per-node, else this machine's")
    s.set_defaults(func=_plan)

    for name, func, text in (("status", _status, "show a job"), ("follow", _follow_cmd, "follow a job"),
                             ("stop", _stop, "stop a job"), ("delete", _delete, "delete a finished job")):
        s = sub.add_parser(name, help=text)
        s.add_argument("job_id")
        s.set_defaults(func=func)
    s = sub.add_parser("metrics", help="print a job's per-step metrics")
    s.add_argument("job_id")
    s.add_argument("--since", type=int, default=0)
    s.add_argument("--plot", metavar="FILE.png", help="draw loss, tokens/s (and a pipeline's bubble) into a PNG")
    s.set_defaults(func=_metrics)
    s = sub.add_parser("scale", help="resize a running job's data parallelism (at its next step)")
    s.add_argument("job_id")
    s.add_argument("--dp", type=int, required=True, help="the new number of data-parallel replicas")
    s.set_defaults(func=_scale)
    s = sub.add_parser("events", help="what happened to a job: failures, recoveries (with their time), checkpoints")
    s.add_argument("job_id")
    s.set_defaults(func=_events)
    s = sub.add_parser("export", help="download a finished job's trained model: DIR/model.safetensors and "
                                      "DIR/config.json, or a Hugging Face directory (--format hf)")
    s.add_argument("job_id")
    s.add_argument("-o", "--output", required=True, metavar="DIR")
    s.add_argument("--format", choices=("trainyard", "hf"), default="trainyard",
                   help="trainyard (default): one safetensors file; hf: config.json, safetensors, "
                        "generation_config.json and the tokenizer, for transformers.from_pretrained")
    s.set_defaults(func=_export)
    s = sub.add_parser("logs", help="print the ranks' logs (stderr by default), read from Ray")
    s.add_argument("job_id")
    s.add_argument("--rank", type=int, default=None, help="one rank (default: every rank, each line prefixed)")
    s.add_argument("--tail", type=int, default=1000, help="the last N lines of each rank (default 1000)")
    s.add_argument("--stdout", action="store_true", help="the ranks' stdout instead of their stderr")
    s.add_argument("--follow", "-f", action="store_true", help="then print new lines as they come, until the job ends")
    s.set_defaults(func=_logs)
    _add_prepare(sub)
    sub.add_parser("list", help="list jobs").set_defaults(func=_list)
    sub.add_parser("cluster", help="show the Ray cluster").set_defaults(func=_cluster)
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
    s.set_defaults(func=_prepare)


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


def _client(args: argparse.Namespace) -> Client:
    directory = sd.resolve(args.state_dir)
    url = args.url or sd.read_server_url(directory) or "http://127.0.0.1:8000"
    return Client(url, args.token or sd.read_token(directory))


def read_spec_file(path: str) -> dict:
    """The spec as a dict, with relative data paths made absolute (the server may run elsewhere)."""
    from trainyard.api.spec import SpecError, load_spec_text

    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecError([("", f"{path} is not UTF-8 text: {e}")]) from None
    spec = load_spec_text(text)
    for section, key in (("data", "path"), ("data", "val_path"), ("checkpoint", "path"), ("init_from", "hf")):
        part = spec.get(section)
        if isinstance(part, dict) and isinstance(part.get(key), str) and not os.path.isabs(part[key]):
            part[key] = str(Path(part[key]).expanduser().resolve())
    data = spec.get("data")
    for source in (data.get("sources") if isinstance(data, dict) else None) or []:  # a mixture's paths, alike
        if isinstance(source, dict) and isinstance(source.get("path"), str) and not os.path.isabs(source["path"]):
            source["path"] = str(Path(source["path"]).expanduser().resolve())
    return spec


def _costs(text: str) -> dict[str, float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected F,B or F,B,C with non-negative numbers, got {text!r}")
    return dict(zip(("forward", "backward", "comm"), values, strict=False))


def _serve(args: argparse.Namespace) -> int:
    from trainyard.service.server import serve

    return serve(host=args.host, port=args.port, state_dir=args.state_dir, ray_address=args.ray_address,
                 num_cpus=args.num_cpus, max_queued=args.max_queued,
                 allow_fault_injection=args.allow_fault_injection)


def _submit(args: argparse.Namespace) -> int:
    from trainyard.api.spec import SpecError

    try:
        spec = read_spec_file(args.file)
    except SpecError as e:  # as `plan` says it
        print("\n".join(f"error: {f}: {m}" for f, m in e.errors), file=sys.stderr)
        return 2
    client = _client(args)
    job_id = client.submit(spec)
    print(job_id)
    return follow(client, job_id) if args.follow else 0


def _plan(args: argparse.Namespace) -> int:
    from trainyard.api.spec import SpecError, parse_submitted_spec
    from trainyard.parallel.config import RuleError
    from trainyard.parallel.data.datasets import open_dataset
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.plan.present import describe

    try:
        spec = read_spec_file(args.file)
        if args.costs:
            spec["sim_costs"] = {**spec.get("sim_costs", {}), **args.costs}
        ranking = None
        if args.auto and not isinstance(spec.get("parallel"), dict):
            spec["parallel"] = "auto"
        config = parse_submitted_spec(spec)
        if config.parallel == "auto" or args.auto:  # a mapping's layout is the planner's, its other options kept
            config, ranking = _choose(config, args)
        plan = make_plan(config)
        open_dataset(config)
    except SpecError as e:
        print("\n".join(f"error: {f}: {m}" for f, m in e.errors), file=sys.stderr)
        return 2
    except RuleError as e:  # PlanError, DatasetError
        print(f"error: {e}", file=sys.stderr)
        return 2
    described = describe(plan)
    if ranking is not None:
        described["planner"] = ranking
    print(json.dumps(described, indent=2) if args.json else format_plan(described))
    return 0


def _choose(config, args: argparse.Namespace):  # noqa: ANN001, ANN202 - JobConfig; imported lazily
    """`parallel: auto` resolved locally: a described cluster (--nodes ...) or this machine."""
    import os

    from trainyard.parallel.plan.admission import ClusterResources, NodeResources
    from trainyard.parallel.plan.planner import choose
    from trainyard.parallel.runtime.calibrate import machine_costs
    from trainyard.service.state_dir import resolve

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpus = args.cpus_per_node or (8.0 * args.gpus_per_node if args.gpus_per_node else float(os.cpu_count() or 1))
    node = NodeResources(cpus=cpus, gpus=args.gpus_per_node,
                         memory=float(memory), gpu_memory=args.gpu_memory_gib * 2**30 if args.gpus_per_node else 0.0)
    cluster = ClusterResources(nodes=(node,) * max(args.nodes, 1))
    chosen, result = choose(config, cluster, machine_costs(resolve(args.state_dir), cluster))
    return chosen, result.to_dict()


def format_ranking(ranking: dict) -> list[str]:
    """The planner's top layouts: predicted step time, memory per rank, why each lost to the first."""
    lines = [f"planner: {ranking['enumerated']} layouts enumerated, {ranking['evaluated']} evaluated, costs of "
             f"{ranking['node_type']}; best first:"]
    for i, c in enumerate(ranking["candidates"], start=1):
        lay = c["layout"]
        text = " ".join(f"{k.rpartition('.')[2]}={v}" for k, v in lay.items())
        why = f"  -- {c['reason']}" if c["reason"] else "  (chosen)"
        lines.append(f"  {i}. {c['predicted_step_s'] * 1e3:10.2f} ms/step  {format_bytes(c['memory_per_rank']):>10}"
                     f"/rank  bubble {c['bubble_fraction']:.0%}  {text}{why}")
    return lines


def _prepare(args: argparse.Namespace) -> int:
    from trainyard.parallel.data.prepare import PrepareError, PrepareOptions, prepare

    if args.shard_tokens < 1 or args.workers < 1:
        print("error: --shard-tokens and --workers must be at least 1", file=sys.stderr)
        return 2
    options = PrepareOptions(field=args.field, column=args.column, chat=args.chat, eos=args.eos,
                             shard_tokens=args.shard_tokens)
    # SIGTERM (kill, a scheduler's stop) ends it as Ctrl-C does: the workers stopped, the temporary output removed
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        result = prepare([Path(p) for p in args.inputs], Path(args.output), Path(args.tokenizer), options,
                         workers=args.workers)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    m = result.manifest
    if result.skipped:
        print(f"{args.output} is up to date (same inputs, tokenizer and options): nothing to do")
        return 0
    counted = f", {m.counted_tokens} counted in the loss" if m.counted_tokens is not None else ""
    print(f"{args.output}: {m.documents} documents, {m.tokens} tokens{counted} ({m.dtype}, vocab {m.vocab_size}, "
          f"eos {m.eos_id}) in {len(m.shards)} shard(s); {m.tokens / max(result.seconds, 1e-9):.0f} tokens/s")
    return 0


def _span(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def format_plan(d: dict) -> str:
    deg = d["degrees"]
    lines = format_ranking(d["planner"]) if "planner" in d else []
    chosen = d.get("chosen", {})
    if chosen.get("automatically"):
        lines.append(f"layout chosen automatically (predicted step time {chosen['predicted_step_s'] * 1e3:.2f} ms "
                     f"on {chosen['node_type']})")
    lines += [
        f"world size {d['world_size']}  (dp={deg['dp']} pp={deg['pp']} tp={deg['tp']} ep={deg['ep']} vpp={deg['vpp']})",
        f"micro-batches per step per dp rank: {d['microbatches']} of {d['micro_batch_size']} sequences",
        f"resources needed: {d['resources']['needed']}  (per worker {d['resources']['per_worker']})",
        "ranks:",
    ]
    lines += [f"  rank {r['rank']:>3}  {r['name']}  bundle {r['bundle']}" for r in d["ranks"]]
    if d["moe_blocks"]:
        lines.append(f"mixture-of-experts blocks {d['moe_blocks']}; experts hosted per rank: "
                     + "  ".join(f"{r['rank']}:{_span(r['experts'])}" for r in d["ranks"]))
        if deg["ep"] > 1:
            lines.append("expert-parallel groups (exchange tokens): " + "  ".join(str(g) for g in d["groups"]["ep"]))
    if deg["tp"] > 1:
        lines.append("tensor-parallel groups (each one placement-group bundle, so one node): "
                     + "  ".join(str(g) for g in d["groups"]["tp"]))
    lines.append("stage layers: " + "  ".join(f"v{v}={layers}" for v, layers in enumerate(d["stage_layers"])))
    lines += format_memory(d["memory"])
    lines += format_reduction(d["reduction"])
    sync = d["sync"]
    lines.append(f"replica sync {sync['kind']}" + (f" every {sync['every']} steps" if "every" in sync else "")
                 + ": bytes all-reduced across replicas per step, per stage: "
                 + "  ".join(format_bytes(b) for b in sync["cross_replica_bytes_per_step"]))
    s, c = d["schedule"], d["schedule"]["costs"]
    lines += [
        f"schedule {s['kind']}  (pp={s['pp']} vpp={s['vpp']} microbatches={s['microbatches']}; simulated with "
        f"forward={c['forward']:g} backward={c['backward']:g} comm={c['comm']:g} per chunk)",
        f"  makespan {s['makespan']:g}, bubble {s['bubble_fraction']:.1%}, peak activations per stage "
        f"{s['peak_activations']}",
        s["gantt"],
    ]
    return "\n".join(lines)


_MEMORY_COLUMNS = ("params", "grads", "optimizer", "activations", "recompute", "total")
_HOST_COLUMNS = ("host_optimizer", "host_activations")


def format_memory(memory: dict) -> list[str]:
    """The memory plan as a table, one row per set of ranks with the same numbers."""
    rows: dict[tuple[int, ...], list[int]] = {}
    # total: device bytes; host bytes (optimizer and activation offload) in columns of their own, when any
    columns = _MEMORY_COLUMNS + tuple(c for c in _HOST_COLUMNS if any(r.get(c) for r in memory["per_rank"]))
    for r in memory["per_rank"]:
        rows.setdefault(tuple(r[c] for c in columns), []).append(r["rank"])
    width = max(12, *(len(_ranks_text(ranks)) + 6 for ranks in rows.values()))
    lines = ["memory per rank (estimated: what a rank holds at its peak, see the memory plan in docs/guide.md):",
             f"  {'':<{width}}" + "".join(f"{c:>{17 if c in _HOST_COLUMNS else 13}}" for c in columns)]
    for values, ranks in rows.items():
        label = f"{'ranks' if len(ranks) > 1 else 'rank'} {_ranks_text(ranks)}"
        lines.append(f"  {label:<{width}}" + "".join(f"{format_bytes(v):>{17 if c in _HOST_COLUMNS else 13}}"
                                                     for c, v in zip(columns, values, strict=True)))
    return lines + ([f"  {memory['note']}"] if memory.get("note") else [])


def _ranks_text(ranks: list[int]) -> str:
    """0-3,8-11: runs of consecutive ranks."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(_span(run) for run in runs)


def follow(client: Client, job_id: str, poll_s: float = 0.5) -> int:
    """Live progress bar (step/total, loss, tokens/s, ETA) until the job ends, and a line for each change of the
    job's state; exit code 0 iff it succeeded."""
    from tqdm import tqdm

    job = client.job(job_id)
    last_loss, status = None, None
    with tqdm(total=job["steps"], desc=f"{job['name']} {job_id}", unit="step", dynamic_ncols=True) as bar:
        while True:
            job = client.job(job_id)
            if job["status"] != status:  # every change, whatever the state (RECOVERING, RESIZING, ...)
                change = f"{status} -> {job['status']}" if status else job["status"]
                bar.write(f"job {job_id} {change} at {time.strftime('%H:%M:%S')}")
                status = job["status"]
            rows = client.metrics(job_id, since=bar.n)
            if rows:
                last_loss = _finite(rows[-1]["loss"])
                bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{_finite(rows[-1]['tokens_per_s']):.0f}",
                                refresh=False)
                bar.update(rows[-1]["step"] + 1 - bar.n)
            elif job["status"] == "PENDING":
                bar.set_postfix_str(_waiting_text(job), refresh=True)
            if job["status"] in TERMINAL and not rows:
                break
            time.sleep(poll_s)
    print(f"job {job_id} {job['status']} after {job['step']}/{job['steps']} steps"
          + (f"; final loss {last_loss:.4f}" if last_loss is not None else ""))
    if job["error"]:
        print(job["error"], file=sys.stderr)
    return 0 if job["status"] == "SUCCEEDED" else 1


def _finite(value: float | None) -> float:
    """JSON has no NaN or infinity: a diverged step's loss comes as null; show it as nan."""
    return float("nan") if value is None else value


def _waiting_text(job: dict) -> str:
    if job.get("queue_position") is None:
        return "starting"
    return f"queued #{job['queue_position']}: {job['waiting_for']['reason']}"


def _follow_cmd(args: argparse.Namespace) -> int:
    return follow(_client(args), args.job_id)


def _status(args: argparse.Namespace) -> int:
    print(json.dumps(_client(args).job(args.job_id), indent=2))
    return 0


def _stop(args: argparse.Namespace) -> int:
    job = _client(args).stop(args.job_id)
    print(f"job {job['job_id']} {job['status']} at step {job['step']}/{job['steps']}")
    return 0


def _delete(args: argparse.Namespace) -> int:
    _client(args).delete(args.job_id)
    print(f"deleted {args.job_id}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    layout = _client(args).scale(args.job_id, args.dp)
    print(f"job {args.job_id} goes to dp={layout['dp']} ({layout['microbatches']} micro-batches per rank, "
          f"{layout['world_size']} workers) at its next step")
    return 0


def _events(args: argparse.Namespace) -> int:
    for e in _client(args).events(args.job_id):
        when = time.strftime("%H:%M:%S", time.localtime(e["time"]))
        if e["kind"] == "failure":
            print(f"{when} failure {e['failure']} at step {e['step']}: ranks {e['ranks']} on {e['nodes']}, back to "
                  f"step {e['restore_step']} ({e['steps_lost']} steps lost)\n    {e['cause'].splitlines()[0]}")
        elif e["kind"] == "recovered":
            print(f"{when} recovered: step {e['step']} done {e['recovery_s']:.1f} s after failure {e['failure']}")
        elif e["kind"] == "resize":
            print(f"{when} resize at step {e['step']} ({e['reason']}): dp {e['from']['dp']} -> {e['to']['dp']}, "
                  f"paused {e['paused_s']:.1f} s, state moved through {e['moved']}")
        elif e["kind"] == "checkpoint":
            print(f"{when} checkpoint after step {e['step']} (the step was held up {e['blocked_s']:.3f} s)")
        else:
            print(when, json.dumps(e))
    return 0


def _export(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if args.format == "hf" and out.is_dir() and any(out.iterdir()):
        # transformers loads whatever the directory holds: another model's shards or tokenizer would come with it
        print(f"error: {out} is not empty; a Hugging Face export needs a new or empty directory", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if args.format == "hf":
        return _export_hf(args, out)
    from safetensors import safe_open

    path = _client(args).download_model(args.job_id, out / "model.safetensors")
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    (out / "config.json").write_text(json.dumps(json.loads(metadata["config"]), indent=2) + "\n")
    print(f"{path} (after step {metadata['step']}) and {out / 'config.json'}; load it with "
          f"trainyard.parallel.io.export.load_exported({str(path)!r})")
    return 0


def _export_hf(args: argparse.Namespace, out: Path) -> int:
    import tarfile

    archive = _client(args).download_model(args.job_id, out / ".hf.tar", format="hf")
    try:
        with tarfile.open(archive) as tar:
            names = tar.getnames()
            tar.extractall(out, filter="data")
    finally:
        archive.unlink()
    print(f"{out}: {', '.join(sorted(names))}; load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def _metrics(args: argparse.Namespace) -> int:
    client = _client(args)
    rows = client.metrics(args.job_id, since=args.since)
    if args.plot:
        return _plot(client.job(args.job_id), rows, args.plot)
    print(f"{'step':>6} {'loss':>9} {'lr':>10} {'grad_norm':>10} {'tokens/s':>10} {'step_s':>8}")
    for r in rows:
        r = {k: _finite(v) for k, v in r.items()}
        print(f"{r['step']:>6} {r['loss']:>9.4f} {r['lr']:>10.3e} {r['grad_norm']:>10.4f} "
              f"{r['tokens_per_s']:>10.0f} {r['step_time_s']:>8.3f}")
    return 0


def _plot(job: dict, rows: list[dict], path: str) -> int:
    from trainyard.service.plot import plot_metrics

    if not rows:
        print(f"error: job {job['job_id']} ({job['status']}) has no metrics rows to draw yet", file=sys.stderr)
        return 1
    titles = plot_metrics(rows, path, title=f"{job['name']} ({job['job_id']}, {job['status']})")
    print(f"wrote {path}: {', '.join(titles)} over steps {rows[0]['step']}-{rows[-1]['step']}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    client = _client(args)
    stream = "stdout" if args.stdout else "stderr"
    if args.follow:
        return follow_logs(client, args.job_id, args.rank, args.tail, stream)
    for part in client.logs(args.job_id, rank=args.rank, tail=args.tail, stream=stream)["ranks"]:
        _print_log(part, prefixed=args.rank is None)
    return 0


def follow_logs(client: Client, job_id: str, rank: int | None, tail: int, stream: str, poll_s: float = 1.0) -> int:
    """The last `tail` lines of each rank's log, then every new line once as it comes, until the job ends.

    Each rank's lines are counted by the service (`next`), and each poll asks only for the lines after the
    ones printed (`since`). The job is read before its logs, so the last poll, which sees the job ended,
    still reads every line the ranks wrote."""
    printed: dict[tuple[int, int], int] = {}  # (rank, pid) -> lines printed; a rank in a new process starts at 0
    waiting = False
    while True:
        job = client.job(job_id)
        if not job["ranks"] and job["status"] in TERMINAL:
            print(f"job {job_id} {job['status']} without starting its workers: it has no logs", file=sys.stderr)
            return 1
        if not job["ranks"] and not waiting:
            print(f"waiting for job {job_id}'s workers to start ({job['status']})", file=sys.stderr)
            waiting = True
        ranks = [r for r in job["ranks"] if rank is None or r["rank"] == rank]
        if job["ranks"] and not ranks:  # no such rank: the API's 404 names the job's ranks
            ranks = [{"rank": rank, "pid": None}]
        for r in ranks:
            key = (r["rank"], r["pid"])
            since = printed.get(key)
            part = client.logs(job_id, rank=r["rank"], stream=stream, since=since,
                               tail=tail if since is None else MAX_LOG_TAIL)["ranks"][0]
            if since is not None and part["start"] > since:
                print(f"[{part['start'] - since} lines skipped]")
            _print_log(part, prefixed=rank is None, with_error=since is None)
            printed[key] = part["next"]
        if job["status"] in TERMINAL:
            return 0
        time.sleep(poll_s)


def _print_log(part: dict, prefixed: bool, with_error: bool = True) -> None:
    prefix = f"[rank {part['rank']} {part['name']}] " if prefixed else ""
    if part["error"] and with_error:
        print(f"{prefix}{part['error']}", file=sys.stderr)
    for line in part["lines"]:
        print(prefix + line, flush=True)


def _list(args: argparse.Namespace) -> int:
    jobs = _client(args).jobs()
    print(f"{'job_id':<14} {'name':<20} {'status':<10} {'step':>11}  queue")
    for j in jobs:
        queued = f"#{j['queue_position']}" if j.get("queue_position") else ""
        print(f"{j['job_id']:<14} {j['name'][:20]:<20} {j['status']:<10} {j['step']:>5}/{j['steps']:<5}  {queued}")
    return 0


def _cluster(args: argparse.Namespace) -> int:
    print(json.dumps(_client(args).cluster(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
