"""Datasets and the sampler: the global batch of a step depends only on (seed, step), never on the layout."""

import numpy as np
import pytest
import torch
from helpers import tiny_spec
from trainyard.parallel.data.datasets import DatasetError, load_batch, open_dataset
from trainyard.parallel.data.sampler import global_batch_ids, rank_share
from trainyard.parallel.spec import parse_spec


@pytest.mark.parametrize("dp,microbatches", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 8), (8, 1)])
def test_rank_shares_cover_the_global_batch_in_order_for_any_layout(dp, microbatches):
    ids = global_batch_ids(seed=3, step=5, global_batch=16, num_samples=1000)
    shares = [mb for r in range(dp) for mb in rank_share(ids, r, dp, microbatches)]
    assert len(shares) == dp * microbatches
    assert all(len(mb) == 16 // (dp * microbatches) for mb in shares)
    assert [i for mb in shares for i in mb] == ids


def test_global_batch_depends_on_seed_and_step_only():
    a = global_batch_ids(seed=1, step=0, global_batch=32, num_samples=10_000)
    assert a == global_batch_ids(seed=1, step=0, global_batch=32, num_samples=10_000)
    assert a != global_batch_ids(seed=1, step=1, global_batch=32, num_samples=10_000)
    assert a != global_batch_ids(seed=2, step=0, global_batch=32, num_samples=10_000)
    assert all(0 <= i < 10_000 for i in a)


def test_text_dataset_reads_bytes_with_shifted_targets(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(40)))
    ds = open_dataset(parse_spec(tiny_spec(data={"kind": "text", "path": str(path)})))
    assert ds.num_samples == 40 - 16
    inputs, targets = load_batch(ds, [0, 10])
    assert inputs.shape == targets.shape == (2, 16)
    assert inputs[1].tolist() == list(range(10, 26)) and targets[1].tolist() == list(range(11, 27))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokens_dataset_memory_maps_nanogpt_binaries(tmp_path, dtype):
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=dtype).__mod__(300).astype(dtype).tofile(path)
    ds = open_dataset(parse_spec(tiny_spec(model={"vocab_size": 300},
                                           data={"kind": "tokens", "path": str(path), "dtype": dtype})))
    assert isinstance(ds.tokens, np.memmap)
    assert ds.sample(299).tolist()[:2] == [299, 0]


def test_token_ids_outside_the_vocabulary_are_reported_without_the_data(tmp_path):
    path = tmp_path / "bad.bin"
    np.full(100, 500, dtype=np.uint16).tofile(path)
    ds = open_dataset(parse_spec(tiny_spec(data={"kind": "tokens", "path": str(path)})))
    with pytest.raises(DatasetError, match="holds token ids outside model.vocab_size=256") as raised:
        ds.sample(3)
    assert "500" not in str(raised.value) and "offset" not in str(raised.value)  # neither the id nor where


def test_tokens_file_of_partial_ids_is_refused(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 101)
    with pytest.raises(DatasetError, match="not a whole number of uint16"):
        open_dataset(parse_spec(tiny_spec(data={"kind": "tokens", "path": str(path)})))


def test_synthetic_samples_are_a_function_of_seed_and_id():
    ds = open_dataset(parse_spec(tiny_spec(data={"kind": "synthetic", "path": None})))
    assert torch.equal(ds.sample(12), ds.sample(12))
    assert not torch.equal(ds.sample(12), ds.sample(13))
    assert ds.sample(0).shape == (17,)
