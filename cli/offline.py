"""The commands that need no server: `serve` (which starts one), `plan` (validate a JobSpec and show its plan,
locally) and `prepare` (tokenize a corpus into a dataset directory), with the plan's text rendering.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from trainyard.parallel.plan.reduction_bytes import format_reduction
from trainyard.parallel.plan.units import format_bytes


def parse_costs(text: str) -> dict[str, float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 3) or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected F,B or F,B,C with non-negative numbers, got {text!r}")
    return dict(zip(("forward", "backward", "comm"), values, strict=False))


def read_spec_file(path: str) -> dict:
    """The spec as a dict, with relative data paths made absolute (the server may run elsewhere)."""
    from trainyard.parallel.spec import SpecError, load_spec_text

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


def serve(args: argparse.Namespace) -> int:
    from trainyard.api.app import create_app
    from trainyard.service.server import serve
    from trainyard.service.tenancy.trackers import TrackerPolicy
    from trainyard.service.tenancy.uploads import DEFAULT_MAX_UPLOAD_BYTES

    return serve(create_app, host=args.host, port=args.port, state_dir=args.state_dir, ray_address=args.ray_address,
                 num_cpus=args.num_cpus, max_queued=args.max_queued,
                 allow_fault_injection=args.allow_fault_injection,
                 max_upload_bytes=args.max_upload_bytes or DEFAULT_MAX_UPLOAD_BYTES,
                 trackers=TrackerPolicy(args.mlflow_uri, args.wandb_project, args.wandb_entity),
                 base_models=dict(args.base_model))


def base_model(text: str) -> tuple[str, str]:
    """`--base-model NAME=DIR`: the name and the directory, made absolute."""
    name, sep, directory = text.partition("=")
    if not sep or not name.strip() or not directory.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR")
    return name.strip(), str(Path(directory.strip()).expanduser().resolve())


def plan(args: argparse.Namespace) -> int:
    from trainyard.api.spec import parse_submitted_spec
    from trainyard.parallel.config import RuleError
    from trainyard.parallel.data.datasets import open_dataset
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.plan.present import describe
    from trainyard.parallel.spec import SpecError

    try:
        spec = read_spec_file(args.file)
        if args.costs:
            spec["sim_costs"] = {**spec.get("sim_costs", {}), **args.costs}
        ranking = None
        if args.auto and not isinstance(spec.get("parallel"), dict):
            spec["parallel"] = "auto"
        config = parse_submitted_spec(spec)
        prediction = None
        if args.device or args.gpus_per_node:  # a cluster of devices, not this machine
            config, prediction = _on_devices(config, args)
            ranking = prediction.pop("planner", None)
        elif config.parallel == "auto" or args.auto:  # a mapping's layout is the planner's, its other options kept
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
    if prediction is not None:
        described |= prediction  # device, nodes, gpus_per_node, prediction
    print(json.dumps(described, indent=2) if args.json else format_plan(described))
    return 0


def _on_devices(config, args: argparse.Namespace):  # noqa: ANN001, ANN202 - JobConfig; imported lazily
    """The layout (the planner's with --auto) on --nodes x --gpus-per-node GPUs of --device's profile, and its
    prediction; ProfileError (an unknown device) as a RuleError the caller prints."""
    from trainyard.parallel.config import RuleError
    from trainyard.parallel.plan.planner.device_plan import plan_on_devices
    from trainyard.parallel.plan.planner.device_profile import ProfileError

    try:
        return plan_on_devices(config, nodes=max(args.nodes, 1), gpus_per_node=args.gpus_per_node,
                               device=args.device or DEFAULT_DEVICE, auto=args.auto,
                               gpu_memory=args.gpu_memory_gib * 2**30 if args.gpu_memory_gib else 0.0)
    except ProfileError as e:
        raise RuleError("device", str(e)) from None


DEFAULT_DEVICE = "h100-sxm"
"""The profile `--gpus-per-node` plans with when no --device names one (the output names it)."""


def format_prediction(d: dict) -> list[str]:
    """The predicted step on the cluster of devices: throughput, MFU and HFU, memory, where the time goes."""
    p = d["prediction"]
    fits = "fits" if p["fits"] else "DOES NOT FIT"
    lines = [f"predicted on {d['nodes']} x {d['gpus_per_node']} {d['device']} (profile "
             f"parallel/plan/planner/devices/{d['device']}.json; how far to trust it: docs/guide.md):",
             f"  step {p['step_s']:.4g} s  {p['tokens_per_s_per_device']:,.0f} tokens/s per device  MFU {p['mfu']:.1%}"
             f"  HFU {p['hfu']:.1%}",
             f"  memory per device {format_bytes(p['memory_per_device'])} of {format_bytes(p['device_memory'])} "
             f"({fits})",
             "  where the step goes: " + "  ".join(f"{k} {v / p['step_s']:.1%}" for k, v in p["breakdown"].items())]
    return lines


def _choose(config, args: argparse.Namespace):  # noqa: ANN001, ANN202 - JobConfig; imported lazily
    """`parallel: auto` resolved locally: a described cluster (--nodes ...) or this machine."""
    import os

    from trainyard.parallel.plan.admission import ClusterResources, NodeResources
    from trainyard.parallel.plan.planner.planner import choose
    from trainyard.parallel.runtime.calibrate import machine_costs
    from trainyard.service.state_dir import resolve

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpus = args.cpus_per_node or (8.0 * args.gpus_per_node if args.gpus_per_node else float(os.cpu_count() or 1))
    node = NodeResources(cpus=cpus, gpus=args.gpus_per_node, memory=float(memory), gpu_memory=0.0)
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


def prepare(args: argparse.Namespace) -> int:
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
    lines += format_prediction(d) if "prediction" in d else []
    chosen = d.get("chosen", {})
    if chosen.get("automatically"):
        lines.append(f"layout chosen automatically (predicted step time {chosen['predicted_step_s'] * 1e3:.2f} ms "
                     f"on {chosen['node_type']})")
    lines += [
        f"model: {d['model']['summary']}",
        f"world size {d['world_size']}  (dp={deg['dp']} pp={deg['pp']} tp={deg['tp']} ep={deg['ep']} "
        f"cp={deg.get('cp', 1)} vpp={deg['vpp']})",
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
    if deg.get("cp", 1) > 1:
        lines.append("context-parallel groups (each sequence split over one, head-tail; ring attention): "
                     + "  ".join(str(g) for g in d["groups"]["cp"]))
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


_MEMORY_COLUMNS = ("params", "grads", "optimizer", "activations", "recompute", "loss", "reduction", "total",
                   "startup")
"""total: the step's peak on the device (recompute and loss are transients at different times: the larger counts);
reduction (ZeRO-2/3 only): the largest unit's whole gradient before its reduce-scatter; startup: the start-up peak
(the parameter shards and one whole parameter)."""
_HOST_COLUMNS = ("host_optimizer", "host_activations")


def format_memory(memory: dict) -> list[str]:
    """The memory plan as a table, one row per set of ranks with the same numbers."""
    rows: dict[tuple[int, ...], list[int]] = {}
    # total: device bytes; host bytes (optimizer and activation offload) in columns of their own, when any
    # and ZeRO-2/3's reduction transient (part of total) before total, when any
    shown = _MEMORY_COLUMNS + tuple(c for c in _HOST_COLUMNS if any(r.get(c) for r in memory["per_rank"]))
    columns = tuple(c for c in shown if c != "reduction" or any(r.get(c) for r in memory["per_rank"]))
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


