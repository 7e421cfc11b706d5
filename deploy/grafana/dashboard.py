"""trainyard's Grafana dashboard, generated the way Ray generates its own.

Ray declares each dashboard as Python panels (`ray/dashboard/modules/metrics/dashboards/*_panels.py`: a title,
a unit and PromQL targets) and fills a base JSON with them; this file does the same in small. Edit the panels
here, then rewrite the JSON:

    python deploy/grafana/dashboard.py          # writes deploy/grafana/trainyard.json

`tests/unit/test_deploy.py` checks that the committed JSON is what this file produces, and that every metric
a panel queries is defined in actors/ or parallel/.

Names: Ray's Prometheus export prefixes an application metric with `ray_` (`Gauge("trainyard_loss")` is
scraped as `ray_trainyard_loss`), and adds its own labels (`WorkerId`, `SessionName`, `NodeAddress`, ...) to
the metric's tags. Every query therefore aggregates over the labels it does not show (`max by (job_id)`):
a gauge has one writer per job (its coordinator), so `max` only collapses Ray's extra labels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).with_name("trainyard.json")
RAY_PREFIX = "ray_"
JOBS = 'job_id=~"$job_id"'
PANEL_W, PANEL_H, PER_ROW = 12, 8, 2  # Ray's layout: two panels across the 24-column grid


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str  # a Grafana unit id: "none", "s", "percentunit", ...
    targets: tuple[Target, ...]
    min: float | None = None
    max: float | None = None


def latest(metric: str, by: str = "job_id") -> str:
    """The metric's last value per `by`, for the selected jobs."""
    return f"max by ({by}) ({RAY_PREFIX}{metric}{{{JOBS}}})"


ROWS: dict[str, tuple[Panel, ...]] = {
    "Training": (
        Panel("Loss", "Training loss of the last step (trainyard_loss).", "none",
              (Target(latest("trainyard_loss"), "{{job_id}}"),)),
        Panel("Tokens per second", "Training throughput of the last step (trainyard_tokens_per_s).", "short",
              (Target(latest("trainyard_tokens_per_s"), "{{job_id}}"),)),
        Panel("Step time", "Wall time of the last step (trainyard_step_time_s).", "s",
              (Target(latest("trainyard_step_time_s"), "{{job_id}}"),)),
        Panel("Step", "Last finished step (trainyard_step).", "none",
              (Target(latest("trainyard_step"), "{{job_id}}"),)),
    ),
    "Pipeline": (
        Panel("Pipeline bubble", "Measured bubble of the last step: 1 - the stages' forward + backward time / "
              "(pp x the longest stage's wall time) (trainyard_bubble_fraction).", "percentunit",
              (Target(latest("trainyard_bubble_fraction"), "{{job_id}}"),), min=0, max=1),
        Panel("Stage forward and backward time", "Forward and backward time of each pipeline stage in the last "
              "step (trainyard_stage_forward_s, trainyard_stage_backward_s).", "s",
              (Target(latest("trainyard_stage_forward_s", "job_id, stage"), "{{job_id}} stage {{stage}} forward"),
               Target(latest("trainyard_stage_backward_s", "job_id, stage"), "{{job_id}} stage {{stage}} backward"))),
    ),
    "Mixture of experts": (
        Panel("Expert load", "Tokens routed to each expert in the last step (trainyard_moe_expert_load).", "short",
              (Target(latest("trainyard_moe_expert_load", "job_id, layer, expert"),
                      "{{job_id}} layer {{layer}} expert {{expert}}"),)),
        Panel("Expert load imbalance", "The busiest expert's tokens over the mean expert's, per MoE layer "
              "(1 = balanced; from trainyard_moe_expert_load).", "none",
              (Target(f"{latest('trainyard_moe_expert_load', 'job_id, layer')} / "
                      f"avg by (job_id, layer) ({RAY_PREFIX}trainyard_moe_expert_load{{{JOBS}}})",
                      "{{job_id}} layer {{layer}}"),), min=1),
        Panel("Load-balancing loss", "Auxiliary load-balancing loss per MoE layer (trainyard_moe_aux_loss).", "none",
              (Target(latest("trainyard_moe_aux_loss", "job_id, layer"), "{{job_id}} layer {{layer}}"),)),
        Panel("Router z-loss", "Router z-loss per MoE layer (trainyard_moe_z_loss).", "none",
              (Target(latest("trainyard_moe_z_loss", "job_id, layer"), "{{job_id}} layer {{layer}}"),)),
        Panel("Dropped tokens", "Fraction of token-expert assignments dropped for capacity, per MoE layer "
              "(trainyard_moe_dropped_fraction).", "percentunit",
              (Target(latest("trainyard_moe_dropped_fraction", "job_id, layer"), "{{job_id}} layer {{layer}}"),),
              min=0, max=1),
    ),
}

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

BASE = {
    "title": "trainyard",
    "uid": "trainyard",
    "description": "trainyard jobs: loss, throughput, step time, pipeline bubble, MoE expert load (Ray metrics).",
    "tags": ["trainyard", "ray"],
    "editable": True,
    "graphTooltip": 1,
    "refresh": "10s",
    "schemaVersion": 39,
    "time": {"from": "now-1h", "to": "now"},
    "templating": {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "hide": 0, "includeAll": False, "multi": False, "current": {}},
        {"name": "job_id", "label": "Job", "type": "query", "datasource": DATASOURCE,
         "definition": f"label_values({RAY_PREFIX}trainyard_step, job_id)",
         "query": {"query": f"label_values({RAY_PREFIX}trainyard_step, job_id)", "refId": "job_id"},
         "refresh": 2, "sort": 1, "hide": 0, "includeAll": True, "multi": True, "allValue": ".*",
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]}},
    ]},
    "annotations": {"list": []},
    "panels": [],
}


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": panel.unit}
    if panel.min is not None:
        defaults["min"] = panel.min
    if panel.max is not None:
        defaults["max"] = panel.max
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": PANEL_H, "w": PANEL_W, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend}
                    for i, t in enumerate(panel.targets)],
    }


def dashboard() -> dict:
    """The base JSON with a collapsible row per group and its panels two across, as Ray lays them out."""
    panels, panel_id, y = [], 1, 0
    for title, row in ROWS.items():
        panels.append({"id": panel_id, "type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        panel_id, y = panel_id + 1, y + 1
        for i, panel in enumerate(row):
            panels.append(panel_json(panel, panel_id, PANEL_W * (i % PER_ROW), y + PANEL_H * (i // PER_ROW)))
            panel_id += 1
        y += PANEL_H * -(-len(row) // PER_ROW)
    return {**BASE, "panels": panels}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
