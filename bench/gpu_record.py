"""`python -m bench.gpu_record DIR... --commit SHA`: a GPU session's files (`bench/gpu_session.sh`'s $OUT, a folder a
device call) as the rows of bench/results.json's section `gpu`, which replace the section's rows and keep every other
section's; `--summary DIR` prints the rows as a table and writes nothing (the session script's last step, on the
device).

The rows, from whichever of the files are there (a part that failed leaves none, and its rows are missing):
- each `step-*.json` (`bench.gpu`): tokens/s trainyard vs the plain loop (target ratio >= 0.97), the MFU gap
  to the plain loop in points (target <= 2) and the memory plan's device bytes vs `max_memory_allocated` of the
  trainyard side alone (target within 5%);
- `smoke.json` (`bench.gpu_smoke`): the variants that passed on the device, of all (target: every one);
- `big.json` (`bench.gpu_big`): the large Llama's step time, and its device and host peaks vs the plan's figures.
torch alone: it runs on the device too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench.results import Row, at_least, at_most, load, markdown_table, merge, ratio, ratio_within, save

SECTION = "gpu"
GIB = 2**30


def step_rows(r: dict[str, Any]) -> list[Row]:
    ours, plain = r["sides"]["trainyard"], r["sides"]["plain"]
    m = r["model"]
    label = f"{m['family']} {_size(r['params']['total'])}{' compiled' if r['compile'] else ''}"
    where = (f"{r['device']}, torch {r['torch']}; {m['n_layer']} layers, d_model {m['d_model']}; "
             f"{r['precision']}, {r['global_batch']} x {m['seq_len']} tokens a step")
    rows = [Row(f"gpu: {label}, trainyard vs a plain loop, tokens/s", ours["tokens_per_s"], plain["tokens_per_s"],
                r["ratio"], "tokens/s",
                f"{where}; median of {r['rounds']} rotating rounds of {r['steps_per_round']} steps; losses equal to "
                f"{r['loss_max_rel_diff']:.0e} (relative)", target=at_least(0.97, of="ratio"))]
    if ours["mfu"] is not None and plain["mfu"] is not None:
        rows.append(Row(f"gpu: {label}, MFU gap to the plain loop", 100 * (plain["mfu"] - ours["mfu"]), None, None,
                        "points", f"MFU trainyard {100 * ours['mfu']:.1f}%, plain {100 * plain['mfu']:.1f}% of "
                                  f"{r['peak_tflops']:g} TFLOP/s", target=at_most(2.0)))
    memory = r.get("memory", {}).get("trainyard")
    if memory and memory["measured_bytes"]:
        plan, got = memory["plan_bytes"], memory["measured_bytes"]
        rows.append(Row(f"gpu: {label}, memory plan vs max_memory_allocated", plan / GIB, got / GIB,
                        ratio(plan, got), "GiB", "the trainyard side alone, over its construction and warm-up steps",
                        target=ratio_within(memory["target_within"])))
    return rows


def _size(params: int) -> str:
    if params >= 1e9:
        return f"{params / 1e9:.1f}B"
    return f"{params / 1e6:.0f}M" if params >= 1e7 else f"{params / 1e6:.2g}M"


def smoke_rows(r: dict[str, Any]) -> list[Row]:
    """`bench.gpu_smoke --out`: an entry a variant (`ok` true, false, or null where it was skipped), and the device."""
    ran = {name: v for name, v in r.items() if isinstance(v, dict) and v.get("ok") is not None}
    skipped = sorted(name for name, v in r.items() if isinstance(v, dict) and v.get("ok") is None)
    failed = sorted(name for name, v in ran.items() if not v["ok"])
    passed = len(ran) - len(failed)
    note = (f"failed: {', '.join(failed)}" if failed else
            "each against the CPU or its fp32 twin, resumed and exported; host reads within budget")
    return [Row("gpu: one-rank smoke variants that pass on the device", passed, len(ran), ratio(passed, len(ran)), "",
                f"{r['device']}, torch {r['torch']}; {note}" + (f"; skipped: {', '.join(skipped)}" if skipped else ""),
                target=at_least(1.0, of="ratio"))]


def big_rows(r: dict[str, Any]) -> list[Row]:
    plan, device, host = r["plan"], r["device_memory"], r["host_memory"]
    m = r["model"]
    shape = (f"llama {r['params'] / 1e9:.2f}B ({m['n_layer']} blocks, d_model {m['d_model']}), {r['global_batch']} x "
             f"{m['seq_len']} tokens a step, {r['precision']}, recompute {r['activation_checkpointing']}")
    refused = plan["no_offload"]["verdict"] == "refused"
    why = f"without offload the plan {'refuses' if refused else 'ADMITS (a defect)'} it on {plan['device_gib']:g} GiB"
    rows = [Row("gpu: large llama, optimizer offload: step time", r["step_time_s"], None, None, "s",
                f"{r['device']}, torch {r['torch']}; {shape}; {why}; median of {r['timed_steps']} steps "
                f"{r['step_time_median_s']:.2f} s; construction {r['construction']['total_s']:.0f} s")]
    if device["peak_allocated"]:
        rows.append(Row("gpu: large llama: device peak vs the plan", device["peak_allocated"] / GIB,
                        device["plan_total"] / GIB, ratio(device["peak_allocated"], device["plan_total"]), "GiB",
                        "max_memory_allocated over construction and steps vs the plan's total",
                        target=ratio_within(0.05)))
    rows.append(Row("gpu: large llama: host peak vs the plan", host["peak_above_before"] / GIB, host["estimate"] / GIB,
                    ratio(host["peak_above_before"], host["estimate"]), "GiB",
                    f"VmHWM above the RSS before construction vs the plan's host bytes (of which the pinned "
                    f"allocator's rounding: {(host['estimate'] - host['plan_host']) / GIB:.1f} GiB); the machine's "
                    f"available memory fell by at most {host['system_peak_above_before'] / GIB:.1f} GiB"))
    return rows


def rows(folder: Path) -> list[Row]:
    found: list[Row] = []
    for path in sorted(folder.glob("step-*.json"), key=lambda p: (p.stem.removesuffix("-compile"), p.stem)):
        found += step_rows(json.loads(path.read_text()))
    if (folder / "smoke.json").exists():
        found += smoke_rows(json.loads((folder / "smoke.json").read_text()))
    if (folder / "big.json").exists():
        found += big_rows(json.loads((folder / "big.json").read_text()))
    return found


def meta(folders: list[Path], commit: str) -> dict[str, Any]:
    """When, where and how long, from each call's summary.txt (its first lines: the UTC time, the commit if the
    device had one, the device's name, memory and driver, the torch version; then a line a part): the first call's
    time and device, every call's parts."""
    summaries = [folder / "summary.txt" for folder in folders if (folder / "summary.txt").exists()]
    lines = [line for path in summaries for line in path.read_text().splitlines()]
    head = lines[:4] + [""] * 4
    parts = [line for line in lines if " rc=" in line]
    seconds = sum(int(m[1]) for line in parts if (m := re.search(r" (\d+)s$", line)))
    measured = time.strptime(head[0], "%Y-%m-%dT%H:%M:%SZ") if head[0][:2] == "20" else time.gmtime()
    device = next((line for line in head if "," in line and "MiB" in line), "unknown device")
    torch_version = next((line.split(" ", 1)[1] for line in head if line.startswith("torch ")), "unknown")
    return {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S+0000", measured), "wall_s": seconds,
            "machine": {"device": device, "torch": torch_version}, "commit": commit, "parts": parts,
            "command": "bash bench/gpu_session.sh (bench.gpu_smoke, bench.gpu, bench.gpu_big on one GPU)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_record", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", type=Path, nargs="+", help="the session's files ($OUT of bench/gpu_session.sh), a "
                   "folder a device call")
    p.add_argument("--summary", action="store_true", help="print the rows; write nothing")
    p.add_argument("--commit", default=None, help="the commit the session ran (required unless --summary)")
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "results.json")
    args = p.parse_args(argv)
    found = [row for folder in args.folders for row in rows(folder)]
    print(markdown_table(found) if found else f"no results in {', '.join(map(str, args.folders))}")
    if args.summary:
        return 0
    if not found:
        return 1
    if not args.commit:
        p.error("--commit: the commit the session ran (the device has no .git)")
    old = load(args.results)
    order = [*(name for name in old.get("sections", {}) if name != SECTION), SECTION]  # the GPU's section last
    save(args.results, merge(old, {SECTION: found}, {SECTION: meta(args.folders, args.commit)},
                             old.get("machine", {}), order=order))
    print(f"{len(found)} rows written to {args.results}'s section {SECTION}; `python -m bench.report` shows them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
