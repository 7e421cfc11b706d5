"""`trainyard metrics --plot`: the PNG and its panels, drawn from metrics rows without a server."""

from __future__ import annotations

import struct

from trainyard.cli.plot import plot_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rows(steps: int = 20, stages: int = 1, val_every: int | None = None) -> list[dict]:
    out = []
    for step in range(steps):
        row = {"step": step, "loss": 5.5 - 0.1 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 900.0 + step,
               "step_time_s": 0.1, "bubble_fraction": 0.3, "stage_forward_s": [0.01] * stages,
               "stage_backward_s": [0.02] * stages}
        if val_every and step % val_every == 0:
            row["val_loss"] = 5.6 - 0.1 * step
        out.append(row)
    return out


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


def test_a_data_parallel_job_gets_loss_and_throughput_panels(tmp_path):
    path = tmp_path / "dp.png"
    assert plot_metrics(rows(), path, title="dp job") == ["loss", "tokens/s"]
    assert path.stat().st_size > 10_000
    width, height = png_size(path)
    assert width > height > 0


def test_a_pipeline_gets_a_bubble_panel_and_validation_loss_joins_the_loss_panel(tmp_path):
    plain, pipeline = tmp_path / "plain.png", tmp_path / "pipeline.png"
    plot_metrics(rows(), plain)
    titles = plot_metrics(rows(stages=4, val_every=5), pipeline)
    assert titles == ["loss and val_loss", "tokens/s", "pipeline bubble"]
    assert png_size(pipeline)[0] > png_size(plain)[0]  # one more panel side by side


def test_a_diverged_step_with_a_null_loss_still_draws(tmp_path):
    data = rows(steps=5)
    data[2]["loss"] = None  # JSON's NaN
    assert plot_metrics(data, tmp_path / "nan.png") == ["loss", "tokens/s"]
    assert (tmp_path / "nan.png").read_bytes()[:8] == PNG_MAGIC
