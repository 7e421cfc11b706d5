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


def test_an_epochs_job_is_bounded_and_checked_from_one_opening_of_its_data(tmp_path):
    """At submit the training data of a `data.epochs` job is opened once (with packing, that packs it whole, on the
    API's thread): the epochs bound its steps from it, and the input checks take it rather than open it again
    (here they could not: the directory is gone by then)."""
    from data_helpers import bpe_tokenizer
    from helpers import REPO
    from trainyard.parallel.data.prepare import PrepareOptions, prepare
    from trainyard.service.inputs import bound_by_epochs, check_inputs
    from trainyard.service.manager import JobManager
    from trainyard.service.store import JobStore

    prepare([REPO / "examples" / "finetune.jsonl"], tmp_path / "chat", bpe_tokenizer(tmp_path / "tok"),
            PrepareOptions(chat=True), progress=False)
    data = {"kind": "tokens", "path": str(tmp_path / "chat"), "packing": True, "epochs": 2}
    config = parse_spec(tiny_spec(model={"vocab_size": 300, "seq_len": 128}, steps=1000, global_batch=4, data=data))
    train = open_dataset(config)
    (tmp_path / "chat").rename(tmp_path / "moved")
    bounded, events = bound_by_epochs(config, train)
    assert bounded.steps == epochs_steps(2, train.num_samples, 4) < 1000
    assert events[0]["kind"] == "steps_from_epochs" and events[0]["steps"] == bounded.steps
    manager = JobManager(JobStore(tmp_path / "jobs.db"), data_dir=tmp_path)
    try:
        check_inputs(bounded, manager.resume_point, train)  # the data is not opened again
        with pytest.raises(DatasetError):
            check_inputs(bounded, manager.resume_point)  # (as it would be, and fail, without it)
    finally:
        manager.shutdown()
