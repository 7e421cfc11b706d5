"""`bench.planner_replay`: the planner section's saved measurements predicted again, layout by layout."""

from __future__ import annotations

import pytest
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.planner.machine_costs import Fit, MachineCosts
from trainyard.parallel.plan.planner.prediction import predict_step

from bench.planner import GRID, NODE_RANKS, SIZES, _config, _label
from bench.planner_replay import replay

MACHINE = MachineCosts(node_type="test", matmul=Fit(1e-6, 50e9), allreduce=Fit(3e-4, 2e9), p2p=Fit(6e-5, 3e9),
                       alltoall=Fit(3e-4, 1e9), optimizer=Fit(1e-4, 7e8), contention=(1.0, 1.1, 1.6, 2.0))


def test_each_saved_layout_is_predicted_again_and_ranked_against_what_was_measured():
    model = SIZES["small"]
    configs = [_config(model, v) for v in GRID]
    labels = [_label(c) for c in configs]
    predicted = [predict_step(p.config, p.layout, MACHINE, node_gpus=NODE_RANKS) for p in map(make_plan, configs)]
    # measured in the reverse order of the predictions: the worst ranking there is (-1, but for tied predictions)
    order = sorted(range(len(labels)), key=lambda i: predicted[i])
    measured = [0.0] * len(labels)
    for rank, i in enumerate(order):
        measured[i] = 1.0 - rank * 0.01
    saved = {"model": model, "labels": labels, "machine": MACHINE.to_dict(), "steps": [[m, m, m] for m in measured]}
    r = replay(saved)
    assert r["labels"] == labels and r["predicted"] == pytest.approx(predicted)
    assert r["spearman"] < -0.99
    assert r["chosen"] == labels[order[0]] and r["chosen_over_fastest"] == pytest.approx(1.0 / measured[order[-1]])
    assert len(r["without"]) == len(labels) and all(w < -0.99 for w in r["without"])
