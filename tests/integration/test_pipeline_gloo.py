"""The pipeline executor on real gloo process groups, without Ray: every layout follows pp=1's losses."""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import losses, run_ranks
from helpers import tiny_spec

from api.spec import parse_spec
from parallel.plan import make_plan


def plan_for(**parallel):
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 4}, steps=3, global_batch=8, parallel=parallel)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    return losses(plan_for(dp=1, pp=1, microbatches=4), tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("parallel", [
    {"pp": 2, "microbatches": 4, "schedule": "1f1b"},
    {"pp": 2, "microbatches": 4, "schedule": "gpipe"},
    {"pp": 2, "vpp": 2, "microbatches": 4, "schedule": "interleaved-1f1b"},
], ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_pipeline_layouts_match_the_single_stage_losses(parallel, reference, tmp_path):
    got = losses(plan_for(**parallel), tmp_path)
    np.testing.assert_allclose(got, reference, rtol=1e-4)


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_pp(tmp_path):
    gpipe = run_ranks(plan_for(pp=2, microbatches=4, schedule="gpipe"), tmp_path)
    one_f_one_b = run_ranks(plan_for(pp=2, microbatches=4, schedule="1f1b"), tmp_path)
    assert [r[0]["peak_activations"] for r in gpipe] == [4, 4]
    assert [r[0]["peak_activations"] for r in one_f_one_b] == [2, 1]
    assert one_f_one_b[0][0]["peak_activation_bytes"] < gpipe[0][0]["peak_activation_bytes"]
