"""Planning past this machine: device profiles load with a source for every number, `trainyard plan --gpus-per-node
--device` plans GPU ranks with the named profile and predicts the step, the breakdown adds up, collectives across
nodes run on the GPUs' own NICs, and the search past SCALE_RANKS GPU ranks is bounded and says so."""

from __future__ import annotations

import json

import pytest
from helpers import slow
from trainyard.cli.main import main
from trainyard.parallel.config import JobConfig, ModelConfig, ParallelConfig
from trainyard.parallel.plan.planner.device_plan import device_cluster, plan_on_devices
from trainyard.parallel.plan.planner.device_prediction import predict_on_devices
from trainyard.parallel.plan.planner.device_profile import ProfileError, load_profile, profile_names
from trainyard.parallel.plan.planner.planner import plan_layouts
from trainyard.parallel.plan.planner.planner_search import SCALE_RANKS


def small(parallel: ParallelConfig | str = "auto", checkpointing: str = "none") -> JobConfig:
    model = ModelConfig(family="gpt2", n_layer=4, n_head=8, d_model=1024, vocab_size=8192, seq_len=512)
    return JobConfig(model=model, steps=1, global_batch=32, precision="bf16", parallel=parallel,
                     activation_checkpointing=checkpointing)


@pytest.mark.parametrize("name", ["a100-80gb", "h100-sxm", "h200", "h100-96gb-500w"])
def test_each_shipped_profile_loads_with_a_source_for_every_number(name):
    profile = load_profile(name)
    assert name in profile_names()
    assert profile.peak_bf16 > 0 and profile.hbm_bytes > 0 and profile.gpus_per_node == 8
    assert all(text.strip() for text in profile.sources.values()), profile.sources
    assert {"peak_flops.bf16", "hbm.bytes", "nvlink.bytes_per_s", "network.nic_bytes_per_s", "matmul_efficiency",
            "collectives.allreduce_in_node", "collectives.across_nodes"} <= set(profile.sources)
    costs = profile.machine_costs()
    assert costs.peak_flops == profile.peak_bf16 and not costs.contention  # each rank its own device


def test_an_unknown_device_is_refused_naming_the_known_ones():
    with pytest.raises(ProfileError, match="h100-sxm"):
        load_profile("tpu-v9")


def test_h200_differs_from_h100_in_memory_not_compute():
    h100, h200 = load_profile("h100-sxm"), load_profile("h200")
    assert h200.peak_bf16 == h100.peak_bf16
    assert h200.hbm_bytes > 1.5 * h100.hbm_bytes and h200.hbm_bytes_per_s > h100.hbm_bytes_per_s


def test_gpus_per_node_plans_gpu_ranks_with_the_named_profile(tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text("name: g\nmodel: {family: gpt2, n_layer: 4, n_head: 8, d_model: 1024, vocab_size: 8192, "
                    "seq_len: 512}\nsteps: 1\nglobal_batch: 32\nprecision: bf16\ndata: {kind: synthetic}\n")
    code = main(["plan", str(spec), "--auto", "--nodes", "1", "--gpus-per-node", "4", "--device", "a100-80gb",
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["device"] == "a100-80gb" and "a100-80gb" in out["planner"]["node_type"]
    needed = out["resources"]["needed"]
    assert needed["GPU"] == out["world_size"] > 0  # one GPU a rank, not CPU ranks
    p = out["prediction"]
    assert p["step_s"] > 0 and p["tokens_per_s_per_device"] > 0 and 0 < p["mfu"] <= p["hfu"] < 1
    assert p["device_memory"] == load_profile("a100-80gb").hbm_bytes
    assert abs(sum(p["breakdown"].values()) - p["step_s"]) < 1e-6 * p["step_s"]


def test_the_breakdown_adds_up_to_the_step_and_full_recompute_counts_in_hfu():
    par = ParallelConfig(dp=2, pp=2, tp=2, microbatches=4, schedule="1f1b")
    machine = load_profile("h100-sxm").machine_costs()
    pred = predict_on_devices(small(par, "full"), device_cluster(2, 4, load_profile("h100-sxm")), machine)
    assert abs(sum(pred.breakdown.values()) - pred.step_s) < 1e-6 * pred.step_s
    assert pred.breakdown["recompute"] > 0 and pred.breakdown["bubble"] > 0 and pred.breakdown["tp all-reduce"] > 0
    assert pred.hfu == pytest.approx(pred.mfu * 4 / 3)
    assert pred.world == 8


def test_a_collective_across_nodes_runs_on_the_nics_of_its_ranks_on_each_node():
    costs = load_profile("h100-sxm").machine_costs()
    size, n = 2**30, 64
    in_node = costs.collective("allreduce", size, 8)
    one_rail = costs.collective("allreduce", size, n, spans_nodes=True, per_node=1)
    eight_rails = costs.collective("allreduce", size, n, spans_nodes=True, per_node=8)
    assert one_rail > 4 * eight_rails  # one NIC against eight
    assert eight_rails > in_node  # eight NICs together are still slower than the node's NVSwitch


def test_compile_runs_the_model_faster_on_a_profile():
    cluster, machine = device_cluster(1, 8, load_profile("h100-sxm")), load_profile("h100-sxm").machine_costs()
    par = ParallelConfig(dp=8, zero=3, microbatches=1)
    eager = predict_on_devices(small(par), cluster, machine)
    from dataclasses import replace

    compiled = predict_on_devices(replace(small(par), compile=True), cluster, machine)
    assert compiled.step_s < eager.step_s


def test_past_scale_ranks_the_search_uses_every_gpu_and_says_its_bounds():
    profile = load_profile("h100-sxm")
    nodes = SCALE_RANKS // 8 * 2
    cluster = device_cluster(nodes, 8, profile)
    config = small(ParallelConfig())
    config = JobConfig(model=config.model, steps=1, global_batch=256, precision="bf16")
    result = plan_layouts(config, cluster, profile.machine_costs())
    assert "every GPU used" in result.bounds
    for cand in result.candidates:
        par = cand.config.parallel
        assert par.dp * par.pp * par.tp == nodes * 8


def test_plan_on_devices_keeps_a_fixed_layout_and_gives_its_ranks_one_gpu():
    par = ParallelConfig(dp=4, tp=2, microbatches=2)
    config, out = plan_on_devices(small(par), nodes=1, gpus_per_node=8, device="h200")
    assert config.parallel.dp == 4 and config.parallel.tp == 2
    assert config.resources.gpus_per_worker == 1
    assert out["prediction"]["fits"] and out["device"] == "h200"


@slow
def test_a_1t_gpt_on_3072_gpus_gets_a_layout_that_fits_within_the_search_bounds():
    model = ModelConfig(family="gpt2", n_layer=128, n_head=160, d_model=25600, vocab_size=51200, seq_len=2048)
    config = JobConfig(model=model, steps=1, global_batch=3072, precision="bf16", parallel="auto")
    chosen, out = plan_on_devices(config, nodes=384, gpus_per_node=8, device="a100-80gb")
    par = chosen.parallel
    assert par.dp * par.pp * par.tp == 3072 and par.tp <= 8
    assert out["prediction"]["fits"] and out["prediction"]["memory_per_device"] <= 80 * 2**30
    assert "at most 500 layouts sized" in out["planner"]["bounds"]
