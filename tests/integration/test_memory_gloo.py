"""The memory plan against what real gloo ranks hold (no Ray).

Each rank builds its RankTrainer, runs one step, and reports its local parameter bytes (a DTensor's local
shard), its gradient buckets (and ZeRO-1's reduced slices), its optimizer's state (`optimizer_bytes`) and the
pipeline meter's peak of bytes saved for backward; the plan's estimate must match the first three (up to
the buckets' padding to a multiple of the group size) and the activations within 25%.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_ranks import spawn
from helpers import tiny_spec

from api.spec import parse_spec
from parallel.data import open_dataset, step_microbatches
from parallel.data_parallel import local_part
from parallel.distributed import init_distributed, shutdown_distributed
from parallel.plan import Plan, make_plan
from parallel.trainer import RankTrainer

MOE = {"experts": 4, "top_k": 2, "every": 2}


def _measure_rank(rank: int, port: int, plan: Plan, out_dir: str) -> None:
    torch.set_num_threads(1)
    groups = init_distributed(plan, rank, "127.0.0.1", port, torch.device("cpu"), timeout_s=120)
    trainer = RankTrainer(plan, rank, groups, torch.device("cpu"))
    cfg = plan.config
    stats = trainer.train_step(0, step_microbatches(plan, rank, 0, open_dataset(cfg).num_samples))
    params = {id(p): local_part(p) for chunk in trainer.chunks for p in chunk.parameters()}
    buckets = [t for reducer in trainer.reducers.values() for b in reducer.buckets for t in (b.flat, b.shard)
               if t is not None]
    measured = {
        "params": sum(p.numel() * p.element_size() for p in params.values()),
        "grads": sum(t.numel() * t.element_size() for t in buckets),
        "optimizer": stats.optimizer_bytes,
        "activations": stats.peak_activation_bytes,
    }
    torch.save(measured, Path(out_dir) / f"rank{rank}.pt")
    shutdown_distributed()


LAYOUTS = {
    "pp2-1f1b-m4": {"parallel": {"pp": 2, "microbatches": 4}},
    "pp2-vpp2-interleaved-bf16-full": {"precision": "bf16", "activation_checkpointing": "full",
                                       "parallel": {"pp": 2, "vpp": 2, "microbatches": 4,
                                                    "schedule": "interleaved-1f1b"}},
    "tp2-sp-bf16-selective": {"precision": "bf16", "activation_checkpointing": "selective",
                              "parallel": {"tp": 2, "sp": True, "microbatches": 2}},
    "moe-dp2-ep2-zero1-gpipe-selective": {"model": {"moe": MOE}, "activation_checkpointing": "selective",
                                          "parallel": {"dp": 2, "ep": 2, "zero": 1, "microbatches": 2,
                                                       "schedule": "gpipe"}},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_memory_plan_matches_what_the_ranks_hold(layout, tmp_path):
    overrides = LAYOUTS[layout]
    model = {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 32, **overrides.get("model", {})}
    plan = make_plan(parse_spec(tiny_spec(**{**overrides, "model": model, "steps": 1, "global_batch": 8})))
    spawn(_measure_rank, plan.world_size, plan, str(tmp_path))
    for rank, expected in enumerate(plan.memory()):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["params"] == expected.params, rank
        assert got["grads"] == pytest.approx(expected.grads, abs=64), rank  # padding: a few elements a bucket
        assert got["optimizer"] == pytest.approx(expected.optimizer, abs=64), rank
        assert got["activations"] == pytest.approx(expected.activations, rel=0.25), rank
        print(f"{layout} rank {rank}: " + ", ".join(f"{k} {getattr(expected, k)} vs {v}" for k, v in got.items()))
