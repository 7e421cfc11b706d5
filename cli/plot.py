"""`trainyard metrics ID --plot FILE.png`: a job's per-step metrics rows drawn as one PNG.

Panels, over steps: the loss (and `val_loss` once any row has one), tokens/s, and for a pipeline (rows with
more than one stage) the measured bubble fraction. matplotlib is imported here only, so the CLI starts fast,
and drawn through a bare `Figure` (the Agg canvas, no pyplot state, no display needed).
"""

from __future__ import annotations

from pathlib import Path


def panels(rows: list[dict]) -> list[str]:
    """The titles of the panels `plot_metrics` draws for these rows, in order."""
    titles = ["loss and val_loss" if any(r.get("val_loss") is not None for r in rows) else "loss", "tokens/s"]
    if any(len(r.get("stage_forward_s") or []) > 1 for r in rows):
        titles.append("pipeline bubble")
    return titles


def plot_metrics(rows: list[dict], path: str | Path, title: str = "") -> list[str]:
    """Draw `rows` (as `GET /api/jobs/{id}/metrics` returns them) into the PNG at `path`; returns the
    titles of the panels it drew."""
    from matplotlib.figure import Figure

    titles = panels(rows)
    fig = Figure(figsize=(5 * len(titles), 3.4), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(titles), squeeze=False)[0]
    steps = [r["step"] for r in rows]
    for ax, name in zip(axes, titles, strict=True):
        if name.startswith("loss"):
            ax.plot(steps, [_number(r["loss"]) for r in rows], label="train")
            val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
            if val:
                ax.plot(*zip(*val, strict=True), marker="o", label="validation")
                ax.legend()
        elif name == "tokens/s":
            ax.plot(steps, [_number(r["tokens_per_s"]) for r in rows])
        else:
            ax.plot(steps, [_number(r["bubble_fraction"]) for r in rows])
            ax.set_ylim(0, 1)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(path, format="png")
    return titles


def _number(value: float | None) -> float:
    """JSON has no NaN: a diverged step's value comes as null; matplotlib leaves a gap for nan."""
    return float("nan") if value is None else value
