"""The commands over the API: submit, follow, status, stop, delete, scale, events, export, metrics, logs, list
and cluster. Each finds the server and its token in the state directory `serve` wrote (or `--url`/`--token`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from trainyard.cli.client import Client
from trainyard.cli.offline import read_spec_file
from trainyard.service import state_dir as sd

TERMINAL = {"STOPPED", "SUCCEEDED", "FAILED"}
MAX_LOG_TAIL = 100_000
def client_of(args: argparse.Namespace) -> Client:
    directory = sd.resolve(args.state_dir)
    url = args.url or sd.read_server_url(directory) or "http://127.0.0.1:8000"
    return Client(url, args.token or sd.read_token(directory))


def submit(args: argparse.Namespace) -> int:
    from trainyard.parallel.spec import SpecError

    try:
        spec = read_spec_file(args.file)
    except SpecError as e:  # as `plan` says it
        print("\n".join(f"error: {f}: {m}" for f, m in e.errors), file=sys.stderr)
        return 2
    client = client_of(args)
    job_id = client.submit(spec)
    print(job_id)
    return follow(client, job_id) if args.follow else 0


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
                epoch = {"epoch": f"{rows[-1]['epoch']:.2f}"} if rows[-1].get("epoch") is not None else {}
                bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{_finite(rows[-1]['tokens_per_s']):.0f}",
                                **epoch, refresh=False)
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


def follow_job(args: argparse.Namespace) -> int:
    return follow(client_of(args), args.job_id)


def status(args: argparse.Namespace) -> int:
    print(json.dumps(client_of(args).job(args.job_id), indent=2))
    return 0


def stop(args: argparse.Namespace) -> int:
    job = client_of(args).stop(args.job_id)
    print(f"job {job['job_id']} {job['status']} at step {job['step']}/{job['steps']}")
    return 0


def upload(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.exists():
        print(f"error: {path}: no such file or directory", file=sys.stderr)
        return 2
    answer = client_of(args).upload(path, args.name)
    print(f"uploaded {answer['kind']} {answer['name']} ({answer['bytes']} bytes) as {answer['upload_id']}; a spec "
          "names it as:", file=sys.stderr)
    print(answer["path"])
    return 0


def files(args: argparse.Namespace) -> int:
    client = client_of(args)
    if args.files_command == "rm":
        client.delete_upload(args.upload_id)
        print(f"deleted upload {args.upload_id}", file=sys.stderr)
        return 0
    rows = client.uploads()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['upload_id']}  {row['kind']:<9}  {row['bytes']:>12}  {row['path']}")
    return 0


def delete(args: argparse.Namespace) -> int:
    client_of(args).delete(args.job_id)
    print(f"deleted {args.job_id}")
    return 0


def scale(args: argparse.Namespace) -> int:
    layout = client_of(args).scale(args.job_id, args.dp)
    print(f"job {args.job_id} goes to dp={layout['dp']} ({layout['microbatches']} micro-batches per rank, "
          f"{layout['world_size']} workers) at its next step")
    return 0


def events(args: argparse.Namespace) -> int:
    for e in client_of(args).events(args.job_id):
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


def export(args: argparse.Namespace) -> int:
    out = Path(args.output)
    if args.format in ("hf", "peft") and out.is_dir() and any(out.iterdir()):
        # transformers loads whatever the directory holds: another model's shards or tokenizer would come with it
        print(f"error: {out} is not empty; a Hugging Face export needs a new or empty directory", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if args.format in ("hf", "peft"):
        return _export_hf(args, out)
    from safetensors import safe_open

    path = client_of(args).download_model(args.job_id, out / "model.safetensors")
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    (out / "config.json").write_text(json.dumps(json.loads(metadata["config"]), indent=2) + "\n")
    print(f"{path} (after step {metadata['step']}) and {out / 'config.json'}; load it with "
          f"trainyard.parallel.io.export.load_exported({str(path)!r})")
    return 0


def _export_hf(args: argparse.Namespace, out: Path) -> int:
    import tarfile

    archive = client_of(args).download_model(args.job_id, out / ".hf.tar", format=args.format)
    try:
        with tarfile.open(archive) as tar:
            names = tar.getnames()
            tar.extractall(out, filter="data")
    finally:
        archive.unlink()
    how = (f"peft.PeftModel.from_pretrained(base, {str(out)!r}), base: the job's init_from model"
           if args.format == "peft" else f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    print(f"{out}: {', '.join(sorted(names))}; load it with {how}")
    return 0


def metrics(args: argparse.Namespace) -> int:
    client = client_of(args)
    rows = client.metrics(args.job_id, since=args.since)
    if args.plot:
        return _plot(client.job(args.job_id), rows, args.plot)
    epochs = any(r.get("epoch") is not None for r in rows)
    print(f"{'step':>6}" + (f" {'epoch':>6}" if epochs else "") +
          f" {'loss':>9} {'val_loss':>9} {'lr':>10} {'grad_norm':>10} {'tokens/s':>10} {'step_s':>8}")
    for r in rows:
        # val_loss is null on the steps without an eval: '-', not nan
        val = f"{r['val_loss']:>9.4f}" if r.get("val_loss") is not None else f"{'-':>9}"
        r = {k: _finite(v) for k, v in r.items()}
        epoch = f" {r['epoch']:>6.2f}" if epochs and r.get("epoch") is not None else f" {'-':>6}" if epochs else ""
        print(f"{r['step']:>6}{epoch} {r['loss']:>9.4f} {val} {r['lr']:>10.3e} {r['grad_norm']:>10.4f} "
              f"{r['tokens_per_s']:>10.0f} {r['step_time_s']:>8.3f}")
    return 0


def tensorboard(args: argparse.Namespace) -> int:
    where = client_of(args).tracking(args.job_id)
    if "tensorboard" not in where:
        print(f"error: job {args.job_id} logs no TensorBoard events (its spec has no `tracking: {{tensorboard: "
              "true}`)", file=sys.stderr)
        return 1
    print(where["tensorboard"])
    return 0


def _plot(job: dict, rows: list[dict], path: str) -> int:
    from trainyard.cli.plot import plot_metrics

    if not rows:
        print(f"error: job {job['job_id']} ({job['status']}) has no metrics rows to draw yet", file=sys.stderr)
        return 1
    titles = plot_metrics(rows, path, title=f"{job['name']} ({job['job_id']}, {job['status']})")
    print(f"wrote {path}: {', '.join(titles)} over steps {rows[0]['step']}-{rows[-1]['step']}")
    return 0


def logs(args: argparse.Namespace) -> int:
    client = client_of(args)
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


def list_jobs(args: argparse.Namespace) -> int:
    jobs = client_of(args).jobs()
    print(f"{'job_id':<14} {'name':<20} {'status':<10} {'step':>11}  queue")
    for j in jobs:
        queued = f"#{j['queue_position']}" if j.get("queue_position") else ""
        print(f"{j['job_id']:<14} {j['name'][:20]:<20} {j['status']:<10} {j['step']:>5}/{j['steps']:<5}  {queued}")
    return 0


def cluster(args: argparse.Namespace) -> int:
    print(json.dumps(client_of(args).cluster(), indent=2))
    return 0


