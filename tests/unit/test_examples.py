"""Whole examples (`parallel.data.examples`): pieces that hold every target of a document exactly once, and
epochs in which every sequence is seen once, as a function of (seed, step) alone."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_spec
from trainyard.parallel.data.datasets import DatasetError, open_dataset
from trainyard.parallel.data.examples import epoch_batch_ids, epoch_of, epochs_steps, pieces
from trainyard.parallel.spec import parse_spec


def test_pieces_cover_each_target_once_and_overlap_by_one_token():
    ends = np.array([5, 6, 20, 23])  # documents [0,5) [5,6) [6,20) [20,23): the one-token one has no target
    starts, stops, cut = pieces(ends, seq_len=4)
    assert starts.tolist() == [0, 6, 10, 14, 18, 20] and stops.tolist() == [5, 11, 15, 19, 20, 23] and cut == 1
    targets = sorted(t for a, b in zip(starts, stops, strict=True) for t in range(a + 1, b))
    assert targets == [t for a, b in ((0, 5), (6, 20), (20, 23)) for t in range(a + 1, b)]
    assert (stops - starts).max() <= 5
    assert pieces(np.array([20, 23]), 4, begin=6)[0].tolist() == [6, 10, 14, 18, 20]


@pytest.mark.parametrize("sequences,batch", [(10, 4), (7, 7), (3, 8)])
def test_each_epoch_is_a_permutation_and_the_ids_depend_on_the_step_alone(sequences, batch):
    steps = epochs_steps(3, sequences, batch)
    ids = [i for step in range(steps) for i in epoch_batch_ids(5, step, batch, sequences)]
    for epoch in range(3):
        assert sorted(ids[epoch * sequences:(epoch + 1) * sequences]) == list(range(sequences))
    assert ids[:sequences] != ids[sequences:2 * sequences] or sequences < 3  # reshuffled each epoch
    assert epoch_batch_ids(5, steps - 1, batch, sequences) == ids[-batch:]  # no state: a resume reads the same
    assert epoch_of(steps - 1, batch, sequences) >= 3 > epoch_of(steps - 2, batch, sequences)


def test_epochs_need_whole_examples_from_a_prepared_directory():
    with pytest.raises(DatasetError, match="set data.packing") as e:
        open_dataset(parse_spec(tiny_spec(data={"epochs": 2})))
    assert e.value.field == "data.epochs"
    with pytest.raises(DatasetError, match="one `trainyard prepare` directory") as e:
        open_dataset(parse_spec(tiny_spec(data={"packing": False})))
    assert e.value.field == "data.packing"
