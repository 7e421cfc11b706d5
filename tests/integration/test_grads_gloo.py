"""PowerSGD gradient compression and `compile: true` on real gloo ranks, all plans in one spawned world.

The compressors' math on two ranks (a probe on the dp=2 reference's world: the reducer on hand-set
gradients; PowerSGD's, and top-k's and QSGD's, whose whole runs are tests/integration/test_compressors_gloo.py),
then whole runs: powersgd at full rank equals the uncompressed reduction (dp2, and with ZeRO-1;
dp2 tp2 runs in `make bench`: a world of four costs more here than it adds), a rank-2 run trains and sends
a small fraction of the bytes (what the plan says it sends), and compiled blocks follow eager at tp=2 with
sp, at pp=2 with full recompute, at dp=2 over ZeRO-3 (FSDP2) shards and with llama at tp=2. The compile runs
use the `aot_eager` backend (dynamo and AOTAutograd trace the blocks, DTensor and the checkpoint; no code is
generated): inductor's C++ code generation costs half a minute per world on two cores; `make bench` runs inductor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import PlanRun, last_stage_losses, run_plans, stats_of, use_aot_eager
from helpers import tiny_spec
from trainyard.parallel.config import GradCompressionConfig
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.reduction_bytes import reduction_bytes
from trainyard.parallel.plan.sharding import sharding_for
from trainyard.parallel.runtime.compression import make_compressor
from trainyard.parallel.runtime.compression.powersgd import PowerSGD
from trainyard.parallel.runtime.dp.data_parallel import make_reducer
from trainyard.parallel.spec import parse_spec

FULL = {"kind": "powersgd", "rank": 64, "min_compression_rate": 0}
"""Rank above every matrix's smaller side, and every matrix compressed: the approximation is exact."""


def plan_for(steps=3, model=None, **spec):
    return make_plan(parse_spec(tiny_spec(steps=steps, **({"model": model} if model else {}), **spec)))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the expected tensor's largest value (fp32)."""
    return float((got - expected).abs().max() / expected.abs().max())


def _grads(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 12, generator=gen), torch.randn(12, generator=gen)


def _reduce(reducer, params, rank: int, step: int, compressor) -> dict:
    compressor.step = step
    reducer.zero_grad()
    for p, g in zip(params, _grads(rank, step), strict=True):
        p.grad = g  # as a backward leaves a step's first gradient: a tensor of its own, moved into the bucket
    reducer.finish()
    state = reducer._states.get(0)
    return {"w": params[0].grad.clone(), "b": params[1].grad.clone(), "bytes": reducer.wire_bytes,
            "error": state.matrices[0].error.clone() if state and hasattr(state.matrices[0], "error") else None,
            "shard": reducer.buckets[0].shard.clone() if reducer.buckets[0].shard is not None else None}


class _Bucket:
    """What torch's `powerSGD_hook` reads of DDP's GradBucket (which Python cannot construct): one flat
    buffer with the gradients as views of it."""

    def __init__(self, grads: list[torch.Tensor]):
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        sizes, offsets = [g.numel() for g in grads], np.cumsum([0, *[g.numel() for g in grads]])
        self.grads = [self.flat[o:o + n].view(g.shape) for o, n, g in zip(offsets, sizes, grads, strict=False)]

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def buffer(self) -> torch.Tensor:
        return self.flat

    def gradients(self) -> list[torch.Tensor]:
        return self.grads


TORCH_STEPS, TORCH_WARMUP = 5, 2
"""Steps of the comparison with torch's hook; its warm-up (torch refuses fewer than 2 with error feedback)."""


def torch_probe(rank: int) -> dict:
    """Our reducer and torch's own `powerSGD_hook` (error feedback, warm start) on the same gradients from
    the same first Q, rank 2: what each hands back per step (ours sums, torch's averages)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    q0 = torch.randn(12, 2, generator=torch.Generator().manual_seed(5))
    params = [torch.nn.Parameter(torch.zeros(16, 12)), torch.nn.Parameter(torch.zeros(12))]
    compressor = PowerSGD(GradCompressionConfig(rank=2, warmup_steps=TORCH_WARMUP), seed=3)
    compressor.initial_q = lambda key, cols, r, like: q0.clone()
    reducer = make_reducer([params], dist.group.WORLD, sharding_for(0), compressor=compressor)
    state = PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=2,
                          start_powerSGD_iter=TORCH_WARMUP)
    state.p_memory_dict[0], state.q_memory_dict[0] = torch.empty(16 * 2), q0.reshape(-1).clone()  # warm: our Q
    ours, theirs = [], []
    for step in range(TORCH_STEPS):
        ours.append(_reduce(reducer, params, rank, step, compressor))
        bucket = _Bucket(list(_grads(rank, step)))
        powerSGD_hook(state, bucket).wait()
        theirs.append([g.clone() for g in bucket.gradients()])
    return {"ours": [(o["w"], o["b"]) for o in ours], "torch": theirs}


GATHERING = {"topk-full": (GradCompressionConfig(kind="topk", ratio=1.0), 0, 1),
             "topk": (GradCompressionConfig(kind="topk", ratio=0.25), 0, 3),
             "topk-zero1": (GradCompressionConfig(kind="topk", ratio=1.0), 1, 1),
             "qsgd": (GradCompressionConfig(kind="qsgd", levels=7, bucket_size=64), 0, 2),
             "qsgd-again": (GradCompressionConfig(kind="qsgd", levels=7, bucket_size=64), 0, 2)}
"""Top-k and QSGD on the same two ranks: (config, zero, steps)."""


def gathering_probe(rank: int) -> dict:
    """Top-k and QSGD reducers on two ranks' known gradients: each step's reduced gradients, this rank's residual
    (top-k) and what it sent (the codes `encode` made, decoded alone)."""
    out = {}
    for name, (cfg, zero, steps) in GATHERING.items():
        params = [torch.nn.Parameter(torch.zeros(16, 12)), torch.nn.Parameter(torch.zeros(12))]
        compressor = make_compressor(cfg, seed=3)
        reducer = make_reducer([params], dist.group.WORLD, sharding_for(zero), compressor=compressor)
        sent = []

        def encode(key, grad, encode=reducer.encode, reducer=reducer, sent=sent):
            codes = encode(key, grad)
            mine = torch.zeros(grad.numel())
            reducer.add_decoded(mine, codes)
            sent.append(mine.view(16, 12))
            return codes

        reducer.encode = encode
        out[name] = []
        for step in range(steps):
            got = _reduce(reducer, params, rank, step, compressor)
            got["sent"] = sent[-1]
            got["residual"] = reducer.residuals[(0, 0)].view(16, 12).clone() if hasattr(reducer, "residuals") \
                and (0, 0) in reducer.residuals else None
            out[name].append(got)
    return out


def math_probe(driver, stats) -> dict:
    """The reducer on two ranks' known gradients: full rank, rank 1 with warm-up and error feedback, ZeRO-1;
    and against torch's own PowerSGD hook; top-k's and QSGD's (`gathering_probe`)."""
    rank, out = dist.get_rank(), {"torch": torch_probe(dist.get_rank()), **gathering_probe(dist.get_rank())}
    for name, cfg, zero, steps in [("full", GradCompressionConfig(rank=12, min_compression_rate=0), 0, 1),
                                   ("rank1", GradCompressionConfig(rank=1, warmup_steps=1), 0, 3),
                                   ("zero1", GradCompressionConfig(rank=12, min_compression_rate=0), 1, 1)]:
        params = [torch.nn.Parameter(torch.zeros(16, 12)), torch.nn.Parameter(torch.zeros(12))]
        compressor = PowerSGD(cfg, seed=3)
        reducer = make_reducer([params], dist.group.WORLD, sharding_for(zero), compressor=compressor)
        out[name] = [_reduce(reducer, params, rank, step, compressor) for step in range(steps)]
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list]:
    pp2_full = {"parallel": {"pp": 2, "microbatches": 2}, "activation_checkpointing": "full"}
    compile_runs = {
        "tp2-sp": plan_for(2, parallel={"tp": 2, "sp": True}),
        "tp2-sp-compiled": plan_for(2, parallel={"tp": 2, "sp": True}, compile=True),
        "pp2-full": plan_for(2, **pp2_full),
        "pp2-full-compiled": plan_for(2, **pp2_full, compile=True),
        "dp2-zero3": plan_for(2, parallel={"dp": 2, "zero": 3}),
        "dp2-zero3-compiled": plan_for(2, parallel={"dp": 2, "zero": 3}, compile=True),
        # llama's first block takes the tp embedding's output as it is (gpt2 adds positions to it first)
        "llama-tp2": plan_for(2, model={"family": "llama"}, parallel={"tp": 2}),
        "llama-tp2-compiled": plan_for(2, model={"family": "llama"}, parallel={"tp": 2}, compile=True),
    }
    plans = {
        "dp2": plan_for(parallel={"dp": 2}),
        "dp2-powersgd-full": plan_for(parallel={"dp": 2, "grad_compression": FULL}),
        "dp2-zero1-powersgd-full": plan_for(parallel={"dp": 2, "zero": 1, "grad_compression": FULL}),
        "dp2-powersgd-rank2": plan_for(steps=8, model={"d_model": 64}, parallel={
            "dp": 2, "grad_compression": {"kind": "powersgd", "rank": 2, "warmup_steps": 1}}),
    } | compile_runs
    results = run_plans([PlanRun(plan, probe=math_probe if name == "dp2" else None,
                                 setup=use_aot_eager if name in compile_runs else None)
                         for name, plan in plans.items()])
    return {name: Run(plan, result) for (name, plan), result in zip(plans.items(), results, strict=True)}


class Run(list):
    """One plan's [rank] results, with its plan."""

    def __init__(self, plan, results):
        super().__init__(results)
        self.plan = plan


def test_two_ranks_at_full_rank_get_the_exact_sum(runs):
    sums = [a + b for a, b in zip(_grads(0, 0), _grads(1, 0), strict=True)]
    for rank in (0, 1):
        got = runs["dp2"][rank].probe["full"][0]
        assert relative_error(got["w"], sums[0]) < 1e-4
        torch.testing.assert_close(got["b"], sums[1])  # 1-D: sent whole
    # Each rank keeps what its own gradient lost in the projection onto the sum's columns (not nothing: its
    # columns leave that space), and the two errors cancel: nothing of the sum is lost.
    errors = [runs["dp2"][rank].probe["full"][0]["error"] for rank in (0, 1)]
    assert (errors[0] + errors[1]).abs().max() < 1e-4 * sums[0].abs().max()


def test_error_feedback_keeps_what_the_approximation_lost(runs):
    ranks = [runs["dp2"][r].probe["rank1"] for r in (0, 1)]
    warm = ranks[0][0]
    torch.testing.assert_close(warm["w"], _grads(0, 0)[0] + _grads(1, 0)[0])  # warm-up: uncompressed
    assert warm["error"] is None and warm["bytes"] == (16 * 12 + 12) * 4
    carried = torch.zeros(16, 12)
    for step in (1, 2):
        approx = ranks[0][step]["w"]
        torch.testing.assert_close(approx, ranks[1][step]["w"])  # every rank gets the same approximation
        assert torch.linalg.matrix_rank(approx) == 1
        # The errors of a step add up to what the sum lost: sent + kept = this step's gradients + last errors
        sent_and_kept = approx + ranks[0][step]["error"] + ranks[1][step]["error"]
        assert relative_error(sent_and_kept, _grads(0, step)[0] + _grads(1, step)[0] + carried) < 1e-4
        assert ranks[0][step]["error"].abs().max() > 0.1
        carried = ranks[0][step]["error"] + ranks[1][step]["error"]
        assert ranks[0][step]["bytes"] == (12 + 16 * 1 + 12 * 1) * 4  # the bias whole, P and Q


def test_compressed_reduction_equals_torchs_powersgd_hook(runs):
    """The outside reference: torch's `powerSGD_hook` (DDP's, averaging) on the same gradients from the same
    Q, warm-up, then compressed steps with error feedback and warm start: ours is its sum, step for step."""
    for rank in (0, 1):
        probe = runs["dp2"][rank].probe["torch"]
        for step, ((w, b), (tw, tb)) in enumerate(zip(probe["ours"], probe["torch"], strict=True)):
            assert relative_error(w / 2, tw) < 1e-5, step
            torch.testing.assert_close(b / 2, tb)
            if step >= TORCH_WARMUP:
                assert torch.linalg.matrix_rank(w) == 2  # compressed
        last = _grads(0, TORCH_STEPS - 1)[0] + _grads(1, TORCH_STEPS - 1)[0]
        assert relative_error(probe["ours"][-1][0], last) > 0.05  # not the exact sum: it did compress


def test_zero1_keeps_its_slice_of_the_compressed_sum(runs):
    sums = [(a + b).reshape(-1) for a, b in zip(_grads(0, 0), _grads(1, 0), strict=True)]
    whole = torch.cat(sums[::-1])  # a bucket holds its parameters in reverse order
    for rank in (0, 1):
        shard = runs["dp2"][rank].probe["zero1"][0]["shard"]
        assert relative_error(shard, whole[rank * shard.numel():][:shard.numel()]) < 1e-4


def test_topk_and_qsgd_reduce_two_ranks_as_their_papers_say(runs):
    """Top-k at ratio 1 is the plain sum, bitwise (one addition per element either way), and keeps nothing; at
    ratio 0.25 what a rank sent plus what it kept is its gradient plus its last residual, bitwise, and the
    reduced matrix is the sum of what the two ranks sent; ZeRO-1 keeps its slice of the sum. QSGD gives both
    ranks the same sum, near the exact one (within its variance bound) and not equal to it, the same again
    from the same seed and step; and each step's bytes are the payload the plan counts (1-D tensors whole)."""
    from trainyard.parallel.plan.grad_compression import COMPRESSIONS

    sums = [[a + b for a, b in zip(_grads(0, step), _grads(1, step), strict=True)] for step in range(3)]
    ranks = [runs["dp2"][r].probe for r in (0, 1)]
    for r, rank in enumerate(ranks):
        [full] = rank["topk-full"]
        torch.testing.assert_close(full["w"], sums[0][0], rtol=0, atol=0)
        torch.testing.assert_close(full["b"], sums[0][1], rtol=0, atol=0)
        assert not full["residual"].any()
        assert full["bytes"] == 12 * 4 + 16 * 12 * 8  # the bias whole, every (index, value) pair
        whole = torch.cat([s.reshape(-1) for s in sums[0][::-1]])  # a bucket holds its parameters reversed
        shard = rank["topk-zero1"][0]["shard"]
        torch.testing.assert_close(shard, whole[r * shard.numel():][:shard.numel()], rtol=0, atol=0)
    carried = [torch.zeros(16, 12), torch.zeros(16, 12)]
    cfg = GATHERING["topk"][0]
    for step in range(3):
        for r in (0, 1):
            got = ranks[r]["topk"][step]
            assert torch.equal(got["sent"] + got["residual"], _grads(r, step)[0] + carried[r])
            assert torch.count_nonzero(got["sent"]) == 48  # a quarter of 192
            assert got["bytes"] == 12 * 4 + COMPRESSIONS["topk"].matrix(16, 12, cfg, 2).sent
            carried[r] = got["residual"]
        torch.testing.assert_close(ranks[0]["topk"][step]["w"], ranks[0]["topk"][step]["sent"]
                                   + ranks[1]["topk"][step]["sent"], rtol=1e-6, atol=1e-6)
        assert torch.equal(ranks[0]["topk"][step]["w"], ranks[1]["topk"][step]["w"])
    cfg = GATHERING["qsgd"][0]
    for step in range(2):
        w = [ranks[r]["qsgd"][step]["w"] for r in (0, 1)]
        assert torch.equal(w[0], w[1]) and torch.equal(w[0], ranks[0]["qsgd-again"][step]["w"])
        # Lemma 3.1 per rank, buckets of 64: E||Q(g) - g||^2 <= min(64 / 49, 8 / 7) ||g||^2; one draw, 3 x that
        bound = 8 / 7 * sum(_grads(r, step)[0].pow(2).sum() for r in (0, 1))
        assert 0 < (w[0] - sums[step][0]).pow(2).sum() < 3 * bound
        torch.testing.assert_close(ranks[0]["qsgd"][step]["b"], sums[step][1])  # 1-D: whole
        assert ranks[0]["qsgd"][step]["bytes"] == 12 * 4 + COMPRESSIONS["qsgd"].matrix(16, 12, cfg, 2).sent
    assert not torch.equal(ranks[0]["qsgd"][0]["sent"], ranks[1]["qsgd"][0]["sent"])


@pytest.mark.parametrize("name", ["dp2-powersgd-full", "dp2-zero1-powersgd-full"])
def test_powersgd_at_full_rank_follows_the_uncompressed_reduction(runs, name):
    reference = stats_of(runs["dp2"])
    got = stats_of(runs[name])
    np.testing.assert_allclose(last_stage_losses(got), last_stage_losses(reference), rtol=1e-4)
    np.testing.assert_allclose([s["grad_norm"] for s in got[0]], [s["grad_norm"] for s in reference[0]], rtol=1e-4)


def test_powersgd_at_rank_2_trains_on_a_tenth_of_the_bytes(runs):
    stats = stats_of(runs["dp2-powersgd-rank2"])
    losses = last_stage_losses(stats)
    assert losses[-1] < losses[0] - 0.1
    uncompressed, *compressed = [s["reduce_bytes"] for s in stats[0]]  # step 0 is the warm-up
    assert max(compressed) < uncompressed / 10
    # what `trainyard plan` says a rank sends is what it sent
    planned = reduction_bytes(runs["dp2-powersgd-rank2"].plan)["per_stage"][0]
    assert (planned["uncompressed"], planned["sent"]) == (uncompressed, compressed[0])


@pytest.mark.parametrize("eager", ["tp2-sp", "pp2-full", "dp2-zero3", "llama-tp2"])
def test_compiled_blocks_follow_eager(runs, eager):
    reference, compiled = stats_of(runs[eager]), stats_of(runs[f"{eager}-compiled"])
    np.testing.assert_allclose(last_stage_losses(compiled), last_stage_losses(reference), rtol=1e-5)
    for ref_rank, rank in zip(reference, compiled, strict=True):
        np.testing.assert_allclose([s["grad_norm"] for s in rank], [s["grad_norm"] for s in ref_rank], rtol=1e-5)
        assert rank[0]["compile_s"] > 0 and ref_rank[0]["compile_s"] == 0  # the first step compiled the blocks
