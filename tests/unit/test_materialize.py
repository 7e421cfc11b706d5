"""`parallel.runtime.materialize`'s slicing on uneven shards: a module built on the meta device, sharded by tensor
parallelism and FSDP2 (which pads uneven shards and, where tp and dp split the same dimension, places a
`_StridedShard`), then `to_empty`: `fill_local` puts exactly the rows of the whole tensor that this rank holds
(none, for a tensor too short to reach it) into FSDP2's padded storage.

One process plays rank 3 of a world of 4 (dp 2 x tp 2) on torch's fake process group: nothing is communicated
while a module is sharded from values every rank holds (`src_data_rank=None`) or materialized, so one rank's view
is the whole test. Rank 3 is the last on both dimensions: its shards are the short ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
from trainyard.parallel.runtime.materialize import fill_local, local_slices


@pytest.fixture
def rank3_of_4():
    dist.init_process_group("fake", rank=3, world_size=4, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def test_fill_local_puts_this_ranks_rows_of_uneven_fsdp_and_tp_shards(rank3_of_4):
    mesh = rank3_of_4
    whole = {"wide.weight": torch.randn(7, 3), "wide.bias": torch.randn(7), "short.weight": torch.randn(1, 3)}
    with torch.device("meta"):
        model = nn.ModuleDict({"wide": nn.Linear(3, 7), "short": nn.Linear(3, 1, bias=False)})
    # wide: 7 rows over tp (4 + 3), tp rank 1's 3 over dp (2 + 1): rank 3 holds row 6 alone
    parallelize_module(model["wide"], mesh["tp"], ColwiseParallel(), src_data_rank=None)
    fully_shard(model["wide"], mesh=mesh["dp"])
    fully_shard(model["short"], mesh=mesh["dp"])  # 1 row over dp: dp rank 1 holds none
    model.to_empty(device="cpu")
    params = dict(model.named_parameters())
    for name, p in params.items():
        fill_local(p, whole[name])

    assert local_slices(params["wide.weight"]) == (slice(6, 7), slice(0, 3))
    assert torch.equal(params["wide.weight"].to_local(), whole["wide.weight"][6:7])
    assert torch.equal(params["wide.bias"].to_local(), whole["wide.bias"][6:7])
    assert params["short.weight"].to_local().shape == (0, 3)
    # FSDP2's padded storage is what the local tensor views: the values are where its gathers read them
    state = fully_shard.state(model["wide"])  # type: ignore[attr-defined]
    group = state._fsdp_param_group
    assert group is not None
    padded = next(fp for fp in group.fsdp_params if fp.sharded_param is params["wide.weight"])._sharded_param_data
    assert torch.equal(padded.view(-1, 3)[:1], whole["wide.weight"][6:7])


def test_fill_local_refuses_a_whole_tensor_of_another_shape(rank3_of_4):
    with torch.device("meta"):
        linear = nn.Linear(3, 7)
    fully_shard(linear, mesh=rank3_of_4["dp"])
    linear.to_empty(device="cpu")
    with pytest.raises(ValueError, match="holds a local"):
        fill_local(linear.weight, torch.randn(2, 3))  # too short to reach this rank's rows 4..6
