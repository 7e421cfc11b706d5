"""The planner section's last measurements replayed against the cost model as it is now, in a second.

Run: `python -m bench.planner_replay` after `python -m bench.planner` (or `bench.run --only planner`), which leaves
every step time and the calibrated machine in `bench/.runs/planner-<d_model>.json`. For each model size it predicts
every measured layout again with `parallel.plan.planner.prediction.predict_step` and that machine, and prints the
Spearman correlation against the median steps, the predicted layout's measured time over the fastest, and per layout its
measured / predicted ratio and the Spearman over the grid without it: the layouts whose leaving out raises it most are
where the cost model is wrong. A change to the cost model can be tried here before the ten minutes of measuring again
(which remains the test of it: the same machine may be slower or faster next time).
"""

from __future__ import annotations

import json
import statistics
import sys

from trainyard.parallel.config import JobConfig
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.planner.machine_costs import MachineCosts
from trainyard.parallel.plan.planner.prediction import predict_step

from bench.planner import GRID, NODE_RANKS, RAW, _config, _label, spearman

CHOSEN_ONLY = {"dp4 pp1 tp1 m1 zero2": {"parallel": {"dp": 4, "zero": 2}}}
"""Layouts that were measured only as the planner's own choice, not in GRID: their variant by label."""


def replay(saved: dict) -> dict:
    """Predicted and measured (median) step time per label, and the summary figures."""
    machine = MachineCosts.from_dict(saved["machine"])
    configs: dict[str, JobConfig] = {_label(c): c for c in (_config(saved["model"], v) for v in GRID)}
    configs |= {label: _config(saved["model"], v) for label, v in CHOSEN_ONLY.items()}
    labels = [label for label in saved["labels"] if label in configs]
    measured = [statistics.median(saved["steps"][saved["labels"].index(label)]) for label in labels]
    predicted = [predict_step(p.config, p.layout, machine, node_gpus=NODE_RANKS)
                 for p in (make_plan(configs[label]) for label in labels)]
    chosen = predicted.index(min(predicted))
    without = [spearman(predicted[:i] + predicted[i + 1:], measured[:i] + measured[i + 1:]) for i in range(len(labels))]
    return {"labels": labels, "predicted": predicted, "measured": measured, "without": without,
            "spearman": spearman(predicted, measured), "chosen": labels[chosen],
            "chosen_over_fastest": measured[chosen] / min(measured)}


def main() -> int:
    found = sorted(RAW.parent.glob("planner-*.json"))
    if not found:
        print(f"no measurements in {RAW.parent}: run `python -m bench.planner` first")
        return 1
    for path in found:
        saved = json.loads(path.read_text())
        r = replay(saved)
        print(f"\n{path.name}: model {saved['model']}, load {saved['load'][0]:.1f} -> {saved['load'][1]:.1f}")
        print(f"Spearman {r['spearman']:.2f} over {len(r['labels'])} layouts; the model's fastest, {r['chosen']}, "
              f"measured {r['chosen_over_fastest']:.2f}x the fastest")
        print("| layout | predicted ms | measured ms (median) | measured / predicted | Spearman without it |")
        print("|---|---:|---:|---:|---:|")
        for i in sorted(range(len(r["labels"])), key=lambda i: -r["without"][i]):
            print(f"| {r['labels'][i]} | {r['predicted'][i] * 1e3:.1f} | {r['measured'][i] * 1e3:.1f} | "
                  f"{r['measured'][i] / r['predicted'][i]:.2f} | {r['without'][i]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
