"""Packed examples (`data.packing: true`): rows that hold every target once with positions restarting at each
example (`parallel.data.packing`), and a model that attends within each example alone
(`parallel.models.components.documents`): a packed row's logits are those of each example run on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_spec
from trainyard.parallel.data.datasets import IGNORE, counted_targets, load_batch
from trainyard.parallel.data.examples import pieces
from trainyard.parallel.data.packing import PackedDataset, pack
from trainyard.parallel.models import FAMILIES
from trainyard.parallel.models.components.documents import document_mask
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.plan import PlanError, make_plan
from trainyard.parallel.spec import parse_spec

SEQ = 8


def _dataset(ends: list[int], mask: bool = False) -> PackedDataset:
    """Documents ending at `ends` of tokens 1, 2, 3, ... (token t at offset t - 1: a target names its offset)."""
    tokens = np.arange(1, ends[-1] + 1, dtype=np.int64)
    starts, stops, cut = pieces(np.asarray(ends), SEQ)
    loss_mask = (tokens % 3 != 0) if mask else None  # chat data: some targets do not count
    return PackedDataset(tokens=tokens, starts=starts, stops=stops, seq_len=SEQ, vocab_size=64, source="test",
                         pad_id=0, mask=loss_mask, cut_examples=cut)


def test_pack_fills_rows_greedily_in_stream_order():
    assert pack(np.array([3, 4, 2, 8, 1, 7]), 8).tolist() == [0, 2, 3, 4, 6]  # 3+4 | 2 (+8 > 8) | 8 | 1+7


@pytest.mark.parametrize("mask", [False, True])
def test_rows_hold_every_target_once_with_positions_and_segments_per_example(mask):
    ends = [4, 5, 9, 23, 26, 30]  # a one-token document, and one cut into pieces (14 targets > SEQ)
    ds = _dataset(ends, mask)
    inputs, targets = load_batch(ds, list(range(ds.num_samples)))
    raw = torch.stack([ds.pair(i)[1] for i in range(ds.num_samples)])  # before the uncounted are IGNORE
    docs = ds.documents(list(range(ds.num_samples)))
    assert inputs.shape == targets.shape == docs.positions.shape == docs.segments.shape == (ds.num_samples, SEQ)
    seen = []
    for r in range(ds.num_samples):
        for s in docs.segments[r].unique().tolist():
            at = (docs.segments[r] == s).nonzero()[:, 0]
            assert at.tolist() == list(range(int(at[0]), int(at[-1]) + 1))  # contiguous
            assert docs.positions[r, at].tolist() == list(range(len(at)))  # restart at each example
            if raw[r, at[0]] != 0:  # an example (not the padding): each target is the next input in it
                assert (raw[r, at[:-1]] == inputs[r, at[1:]]).all() and (raw[r, at] == inputs[r, at] + 1).all()
            seen += [t for t in targets[r, at].tolist() if t != IGNORE]
        assert (docs.segments[r].diff() >= 0).all()
    starts = [0, *ends[:-1]]
    expected = [t + 1 for a, b in zip(starts, ends, strict=True) for t in range(a + 1, b)
                if not mask or (t + 1) % 3 != 0]
    assert sorted(seen) == expected  # every counted target once, none across two examples
    assert counted_targets(ds, list(range(ds.num_samples))) == len(expected)
    assert ds.num_samples < len(ds.starts)  # some rows hold several examples
    with pytest.raises(TypeError, match="load_batch"):
        ds.sample(0)


def test_the_mask_is_causal_within_each_segment_and_keeps_every_diagonal():
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    mask = document_mask(segments)[0, 0]
    for i in range(8):
        for j in range(8):
            assert bool(mask[i, j]) == (j <= i and segments[0, i] == segments[0, j])
    windowed = document_mask(segments, window=2)[0, 0]
    assert windowed[2].tolist() == [False, True, True, False, False, False, False, False]
    assert windowed.diagonal().all()


@pytest.mark.parametrize("family,extra", [("gpt2", {}), ("llama", {"n_kv_head": 1}),
                                          ("mistral", {"sliding_window": 3})])
def test_a_packed_row_gives_each_example_its_logits_alone(family, extra):
    cfg = parse_spec(tiny_spec(model={"family": family, "vocab_size": 64, "seq_len": SEQ, **extra})).model
    model = full_model(cfg, seed=3).eval()
    ds = _dataset([3, 8, 11, 18, 21], mask=False)
    ids = list(range(ds.num_samples))
    inputs, _ = load_batch(ds, ids)
    docs = ds.documents(ids)
    model.set_documents(docs)
    with torch.no_grad():
        packed = model.lm_head(model.ln_f(model(inputs)))
        model.set_documents(None)
        for r in ids:
            for s in docs.segments[r].unique().tolist()[:-1] if (inputs[r] == 0).any() else \
                    docs.segments[r].unique().tolist():
                at = (docs.segments[r] == s).nonzero()[:, 0]
                alone = model.lm_head(model.ln_f(model(inputs[r, at][None])))[0]
                torch.testing.assert_close(packed[r, at], alone, rtol=0, atol=1e-5)
    assert not torch.isnan(packed).any()  # the padding's rows of the mask are never empty


def test_packing_refuses_compile_and_gpt2_with_sequence_parallelism():
    data = {"kind": "tokens", "path": "/nonexistent", "packing": True}
    with pytest.raises(PlanError, match="compile: false") as e:
        make_plan(parse_spec(tiny_spec(data=data, compile=True)))
    assert e.value.field == "compile"
    with pytest.raises(PlanError, match="sp: false") as e:
        make_plan(parse_spec(tiny_spec(data=data, parallel={"tp": 2, "sp": True})))
    assert e.value.field == "parallel.sp" and "restarts gpt2's learned positions" in e.value.message
    assert [name for name, family in FAMILIES.items() if family.learned_positions] == ["gpt2"]
    make_plan(parse_spec(tiny_spec(model={"family": "llama"}, data=data, parallel={"tp": 2, "sp": True})))
