"""`parallel.runtime.build`: a rank is built in the order its module docstring documents, each step seen doing its
work at its place, and the built rank holds the values of the whole construction.

The order is checked three ways: the docstring's numbered steps are the code's `CHUNK_STEPS` and `RANK_STEPS`; a
build records the steps it ran, in that order (a chunk's steps once per chunk, chunk after chunk); and at every
step (`build_rank`'s `after`) the build in progress is looked at, so each effect (parameters on the meta device,
tp's DTensors, LoRA's frozen base, FSDP2's 2-D shards, storage, the tied copies' own buckets, the reducers, the
optimizer) is seen to appear at its step and not before. One process: a rank of one (no process group), the V
placement's rank 0 of a pp=2 world (two chunks; nothing a build does talks to another rank), and rank 3 of a
dp2 x tp2 ZeRO-3 world on torch's fake process group (as tests/unit/test_materialize.py: sharding meta tensors and
materializing them sends nothing). That a rank built so trains as before is the gloo tests' part: every layout
against one rank (tests/integration/*_gloo.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_spec
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from trainyard.parallel.models import family_of
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.models.components.lora import apply_lora, is_adapter
from trainyard.parallel.models.components.moe import moe_layers
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.runtime import build
from trainyard.parallel.runtime.build import CHUNK_STEPS, RANK_STEPS, BuiltRank, RankBuild, build_rank
from trainyard.parallel.runtime.distributed import RankGroups
from trainyard.parallel.runtime.dp.data_parallel import GradientReducer
from trainyard.parallel.runtime.dp.fsdp import FsdpReducer
from trainyard.parallel.runtime.materialize import local_slices
from trainyard.parallel.runtime.pipeline.tied import TiedEmbeddings
from trainyard.parallel.runtime.tp.local_parts import local_part, own_bucket
from trainyard.parallel.spec import parse_spec

CHUNK_ORDER = ("meta", "tensor_parallel", "lora", "recompute", "compile_blocks", "moe_context")
RANK_ORDER = ("fsdp", "materialize", "init_from", "fsdp_ready", "tied", "reducers", "optimizer")
LORA = {"rank": 4, "alpha": 8}
CPU = torch.device("cpu")


def plan_for(model: dict | None = None, **top: Any) -> Plan:
    return make_plan(parse_spec(tiny_spec(model={"n_layer": 2, **(model or {})}, **top)))


def facts(b: RankBuild) -> dict[str, Any]:
    """What the build in progress shows (the checks below find the step where each first holds)."""
    params = [(name, p) for chunk in b.chunks for name, p in chunk.named_parameters()]
    dtensors = [p for _, p in params if isinstance(p, DTensor)]
    return {
        "chunks": len(b.chunks),
        "meta": bool(params) and all(local_part(p).is_meta for _, p in params),
        "storage": bool(params) and not any(local_part(p).is_meta for _, p in params),
        "tp": bool(dtensors) and all(p.device_mesh.mesh_dim_names == ("tp",) for p in dtensors),
        "dp_tp": any(p.device_mesh.ndim == 2 for p in dtensors),
        "trainable": sorted(name for name, p in params if p.requires_grad),
        "selective": any(getattr(m, "recompute", False) for chunk in b.chunks for m in chunk.modules()),
        "compiled": bool(b.chunks) and all(chunk.compiled_blocks for chunk in b.chunks),
        "moe_context": [layer.context.sequences_per_step for chunk in b.chunks for _, layer in moe_layers(chunk)],
        "sharded": b.sharded is not None,
        "fsdp_initialised": b.sharded is not None and all(
            fully_shard.state(root)._is_root for root in b.sharded.roots if root is not None),  # type: ignore[attr-defined]
        "own_buckets": sum(own_bucket(p) for _, p in params),
        "reducers": tuple(b.reducers),
        "optimizer": b.optimizer is not None,
    }


def watched(plan: Plan, rank: int, groups: RankGroups) -> tuple[BuiltRank, list[tuple[str, dict[str, Any]]]]:
    """The rank built, and after each step its name and `facts`."""
    seen: list[tuple[str, dict[str, Any]]] = []
    built = build_rank(plan, rank, groups, CPU, after=lambda name, b: seen.append((name, facts(b))))
    return built, seen


def first(seen: list[tuple[str, dict[str, Any]]], fact: str, value: Any = True) -> str:
    """The step after which `fact` first has `value`."""
    return next(name for name, f in seen if f[fact] == value)


def whole_values(plan: Plan, rank: int, chunk: DecoderStage) -> dict[str, torch.Tensor]:
    """The chunk's parameters and buffers as the whole construction gives them: built on the CPU from the seed
    (today's `build_stage`), LoRA's adapters added."""
    cfg = plan.config
    whole = family_of(cfg.model).build_stage(cfg.model, [int(i) for i in chunk.blocks], first=chunk.first,
                                             last=chunk.last, seed=cfg.seed, experts=plan.experts_of(rank))
    if cfg.model.lora is not None:
        apply_lora(whole, seed=cfg.seed)
    return dict(whole.named_parameters()) | dict(whole.named_buffers())


def mismatches(plan: Plan, rank: int, built: BuiltRank) -> list[str]:
    """The names of the rank's tensors whose local part is not bitwise its slice of the whole construction."""
    bad = []
    for chunk in built.chunks:
        expected = whole_values(plan, rank, chunk)
        for name, t in [*chunk.named_parameters(), *chunk.named_buffers()]:
            if not torch.equal(local_part(t), expected[name][local_slices(t)]):
                bad.append(name)
    return bad


def test_the_docstring_documents_the_order_the_code_runs():
    assert build.__doc__ is not None
    documented = re.findall(r"^(\d+)\. (\w+)", build.__doc__, re.MULTILINE)
    assert [int(n) for n, _ in documented] == list(range(1, len(documented) + 1))
    assert tuple(name for _, name in documented) == CHUNK_ORDER + RANK_ORDER
    assert tuple(step.__name__ for step in (*CHUNK_STEPS, *RANK_STEPS)) == CHUNK_ORDER + RANK_ORDER


def test_one_rank_is_built_step_by_step_in_the_documented_order():
    plan = plan_for({"lora": LORA, "moe": {"experts": 4, "top_k": 2, "every": 2}}, compile=True,
                    activation_checkpointing="selective", optimizer={"offload": True})
    groups = RankGroups(rank=0, dp=None, pp=None, pp_ranks=[0])
    built, seen = watched(plan, 0, groups)

    assert built.applied == tuple(name for name, _ in seen) == CHUNK_ORDER + RANK_ORDER
    names = [name for name, _ in seen]
    assert all(f["meta"] for _, f in seen[:names.index("materialize")])  # no storage before it, all of it after
    assert first(seen, "storage") == "materialize"
    adapters = sorted(name for name, _ in built.chunks[0].named_parameters() if is_adapter(name))
    assert adapters and first(seen, "trainable", adapters) == "lora"  # the base frozen, the adapters added
    assert first(seen, "selective") == "recompute"
    assert first(seen, "compiled") == "compile_blocks"
    assert first(seen, "moe_context", [plan.config.global_batch]) == "moe_context"  # one MoE block: block 1
    assert not any(f["sharded"] for _, f in seen)  # zero 0: no FSDP2
    assert first(seen, "reducers", ("dense",)) == "reducers"  # the adapters alone: MoE's router and experts frozen
    assert first(seen, "optimizer") == "optimizer"
    assert isinstance(built.reducers["dense"], GradientReducer)
    optimized = {id(t) for group in built.optimizer.param_groups for t in group["params"]}
    assert len(optimized) == len(adapters)  # offloaded: a host copy of each adapter
    assert mismatches(plan, 0, built) == []


def test_the_v_placements_rank_0_builds_its_two_chunks_one_after_the_other_and_marks_both_tied_copies():
    plan = plan_for({"tie_embeddings": True, "n_layer": 4},
                    parallel={"pp": 2, "vpp": 2, "microbatches": 2, "schedule": "zbv"})
    groups = RankGroups(rank=0, dp=None, pp=None, pp_ranks=[0, 1])
    early: list[TiedEmbeddings] = []

    def after(name: str, b: RankBuild) -> None:
        seen.append((name, facts(b)))
        if name == "fsdp":  # the tied copies marked before materialize: its `to_empty` drops the marks
            early.append(TiedEmbeddings(b.chunks, None))
            early[0].mark()
            seen.append(("early mark", facts(b)))

    seen: list[tuple[str, dict[str, Any]]] = []
    built = build_rank(plan, 0, groups, CPU, after=after)

    assert built.applied == CHUNK_ORDER + CHUNK_ORDER + RANK_ORDER
    assert [f["chunks"] for name, f in seen if name == "meta"] == [1, 2]
    assert [c.first for c in built.chunks] == [True, False] and [c.last for c in built.chunks] == [False, True]
    marks = [f["own_buckets"] for _, f in seen]
    names = [name for name, _ in seen]
    assert marks[names.index("early mark")] == 2 and marks[names.index("materialize")] == 0  # lost in to_empty
    assert marks[names.index("tied")] == 2  # marked at its step, after materialize
    assert built.tied.local and built.tied.embedding is built.chunks[0].wte.weight
    assert built.tied.head is built.chunks[1].lm_head.weight
    reducer = built.reducers["dense"]
    assert isinstance(reducer, GradientReducer)
    alone = [b.params for b in reducer.buckets if any(own_bucket(p) for p in b.params)]
    assert sorted(len(params) for params in alone) == [1, 1]  # each copy in a bucket of its own
    assert mismatches(plan, 0, built) == []


@pytest.fixture
def rank3_of_dp2_tp2() -> Iterator[RankGroups]:
    """Rank 3 (dp 1, tp 1) of a dp2 x tp2 world, on torch's fake process group: its groups as
    `init_distributed` makes them for that layout."""
    dist.init_process_group("fake", rank=3, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        yield RankGroups(rank=3, dp=dp, pp=None, pp_ranks=[3], tp=tp, tp_mesh=mesh["tp"], dp_mesh=mesh["dp"],
                         reduce=dp)
    finally:
        dist.destroy_process_group()


def test_a_tp_and_zero3_rank_is_sharded_by_tp_then_lora_then_fsdp_then_materialized(rank3_of_dp2_tp2):
    plan = plan_for({"lora": LORA}, parallel={"dp": 2, "tp": 2, "zero": 3})
    assert plan.coords(3).dp == 1 and plan.coords(3).tp == 1
    built, seen = watched(plan, 3, rank3_of_dp2_tp2)

    assert built.applied == CHUNK_ORDER + RANK_ORDER
    assert first(seen, "tp") == "tensor_parallel"  # tp's DTensors, on the meta device
    adapters = sorted(name for name, _ in built.chunks[0].named_parameters() if is_adapter(name))
    assert first(seen, "trainable", adapters) == "lora"
    after_lora = dict(seen)["lora"]
    assert after_lora["meta"] and after_lora["tp"]  # LoRA's adapters split over tp as their base
    assert first(seen, "dp_tp") == first(seen, "sharded") == "fsdp"  # FSDP2 makes them (dp, tp) DTensors
    assert dict(seen)["fsdp"]["meta"]  # still without storage
    assert first(seen, "storage") == "materialize"
    assert first(seen, "fsdp_initialised") == "fsdp_ready"
    assert isinstance(built.reducers["dense"], FsdpReducer)
    assert mismatches(plan, 3, built) == []  # rank 3's shards of the whole construction, bitwise
