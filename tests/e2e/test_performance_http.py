"""Speed and memory settings through the real service (uvicorn, Ray, gloo), at a (dp=2, pp=2) layout and a
(dp=2, tp=2) one: activation checkpointing (full, selective) and ZeRO-1 follow the plain run within 1e-5,
bf16 within 2e-2 after warm-up; the metrics show what each changes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import run_all, tiny_spec

LAYOUTS = {"dp2-pp2": {"dp": 2, "pp": 2, "microbatches": 2}, "dp2-tp2": {"dp": 2, "tp": 2}}
SETTINGS = {
    "plain": {},
    "full": {"activation_checkpointing": "full"},
    "selective": {"activation_checkpointing": "selective"},
    "zero1": {"parallel": {"zero": 1}},
    "bf16": {"precision": "bf16"},
}


def spec(layout: str, setting: str) -> dict:
    top = dict(SETTINGS[setting])
    parallel = {**LAYOUTS[layout], **top.pop("parallel", {})}
    return tiny_spec(model={"n_layer": 4}, global_batch=8, steps=5, parallel=parallel, **top)


@pytest.fixture(scope="module")
def finished(service) -> dict[str, tuple[dict, list[dict]]]:
    client = service.client()
    out = run_all(client, {(layout, setting): spec(layout, setting) for layout in LAYOUTS for setting in SETTINGS})
    client.close()
    return out


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("setting", ["full", "selective", "zero1"])
def test_setting_follows_the_plain_run(finished, layout, setting):
    np.testing.assert_allclose(losses(finished[layout, setting][1]), losses(finished[layout, "plain"][1]),
                               rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_follows_fp32_after_warm_up(finished, layout):
    bf16, fp32 = losses(finished[layout, "bf16"][1]), losses(finished[layout, "plain"][1])
    np.testing.assert_allclose(bf16[2:], fp32[2:], rtol=2e-2)
    assert bf16 != fp32


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpointing_lowers_the_measured_activation_peak(finished, layout):
    peak = {s: max(finished[layout, s][1][-1]["stage_peak_activation_mb"]) for s in ("plain", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["plain"], peak
