"""Gradients summed through shared memory (`parallel.runtime.dp.shm_reduce`) on three real gloo ranks, without Ray.

The reducer's buckets are rows of one mapped file, and `finish` leaves every rank with the same bits, equal to what
gloo's all-reduce of the same gradients gives (to rounding: three addends summed in another order), slices across
unequal parameters and a padded tail included, two steps in a row, with no file left in /dev/shm; a group that
cannot map the file (here: too little room in /dev/shm, or no /dev/shm) falls back to gloo's all-reduce on every
rank alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import spawn
from torch import nn
from trainyard.parallel.runtime.dp import shm_reduce
from trainyard.parallel.runtime.dp.data_parallel import GradientReducer

WORLD = 3
SHAPES = [(7, 5), (11,), (3, 3, 2), (1,)]  # 35 + 11 + 18 + 1 = 65 values: not a multiple of 3, the tail is padded


def _rank(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {"shared": _steps(rank, shared_memory=True)}
        shm_reduce.HEADROOM = 10**15  # /dev/shm never has room enough
        results["no-room"] = _steps(rank, shared_memory=True)
        shm_reduce.SHM_DIR = Path(out_dir) / "no-such-dir"
        results["fallback"] = _steps(rank, shared_memory=True)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _steps(rank: int, shared_memory: bool) -> dict:
    params = [nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    reducer = GradientReducer([params], dist.group.WORLD, bucket_bytes=64, shared_memory=shared_memory)
    out: dict = {"shared": reducer.rows is not None, "buckets": len(reducer.buckets), "steps": []}
    for step in range(2):
        reducer.zero_grad()
        reducer.arm(0)
        gen = torch.Generator().manual_seed(100 * step + rank)
        grads = [torch.randn(shape, generator=gen) * 10 ** (i - 2) for i, shape in enumerate(SHAPES)]
        loss = sum((p * g).sum() for p, g in zip(params, grads, strict=True))
        loss.backward()  # each parameter's gradient is `grads`' tensor: into its bucket view by the reducer's hook
        reducer.finish()
        expected = [g.clone() for g in grads]
        for g in expected:
            dist.all_reduce(g)
        out["steps"].append({"reduced": [p.grad.clone() for p in params], "gloo": expected,
                             "early": reducer.started_early})
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("shm")
    before = set(shm_reduce.SHM_DIR.glob("trainyard-grads-*"))
    spawn(_rank, WORLD, str(out))
    assert set(shm_reduce.SHM_DIR.glob("trainyard-grads-*")) == before  # every file unlinked once mapped
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("case, shared", [("shared", True), ("no-room", False), ("fallback", False)])
def test_every_rank_ends_with_what_gloos_all_reduce_gives(ranks, case, shared):
    for result in (r[case] for r in ranks):
        assert result["shared"] is shared
        assert result["buckets"] > 1  # 64-byte buckets: the rows hold several, back to back
        for step, first_ranks in zip(result["steps"], ranks[0][case]["steps"], strict=True):
            for got, want, rank0 in zip(step["reduced"], step["gloo"], first_ranks["reduced"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
                assert torch.equal(got, rank0)
            assert step["early"] == 0 if shared else step["early"] > 0
