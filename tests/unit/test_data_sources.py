"""Prepared directories, mixtures of sources and loss masks as the trainer reads them: the same samples at
every layout, the held-out split, counted targets, and the errors a spec gets for unusable data."""

import json
import shutil

import numpy as np
import pytest
import torch
from data_helpers import bpe_tokenizer, word_tokenizer
from helpers import REPO, tiny_spec
from trainyard.parallel.data.datasets import IGNORE, DatasetError, counted_targets, load_batch, open_dataset
from trainyard.parallel.data.prepare import PrepareOptions, prepare
from trainyard.parallel.data.sampler import global_batch_ids, rank_share, validation_batches
from trainyard.parallel.plan import make_plan
from trainyard.parallel.spec import parse_spec


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two pretraining directories (small shards, so windows cross shard boundaries) and a chat one."""
    root = tmp_path_factory.mktemp("data")
    tok = bpe_tokenizer(root / "tok")
    text = (REPO / "examples" / "corpus.txt").read_text()
    (root / "a.txt").write_text(text)
    (root / "b.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in text.split("\n\n")[::-1]))
    prepare([root / "a.txt"], root / "a", tok, PrepareOptions(shard_tokens=97), progress=False)
    prepare([root / "b.jsonl"], root / "b", tok, progress=False)
    prepare([REPO / "examples" / "finetune.jsonl"], root / "chat", tok, PrepareOptions(chat=True), progress=False)
    return root


def config(data, eval_every=0, **model):
    return parse_spec(tiny_spec(model={"vocab_size": 300, **model}, data={"kind": "tokens", "path": None, **data},
                                eval={"every": eval_every}))


@pytest.mark.parametrize("eval_every", [0, 5])
def test_a_prepared_directory_reads_like_one_file_of_its_shards(prepared, tmp_path, eval_every):
    manifest = json.loads((prepared / "a" / "manifest.json").read_text())
    assert len(manifest["shards"]) > 3
    flat = tmp_path / "flat.bin"
    np.concatenate([np.fromfile(prepared / "a" / s["file"], np.uint16) for s in manifest["shards"]]).tofile(flat)
    for split in ["train", "val"] if eval_every else ["train"]:
        ds = open_dataset(config({"path": str(prepared / "a")}, eval_every), split)
        ref = open_dataset(config({"path": str(flat)}, eval_every), split)
        assert ds.num_samples == ref.num_samples
        assert all(torch.equal(ds.sample(i), ref.sample(i)) for i in range(ds.num_samples))


@pytest.mark.parametrize("dp,microbatches", [(2, 1), (4, 2), (8, 1)])
def test_a_mixture_gives_every_layout_the_same_samples(prepared, dp, microbatches):
    ds = open_dataset(config({"sources": [{"path": str(prepared / "a"), "weight": 3},
                                          {"path": str(prepared / "b"), "weight": 1}]}))
    for step in range(3):
        ids = global_batch_ids(seed=7, step=step, global_batch=16, num_samples=ds.num_samples)
        whole = load_batch(ds, ids)
        shares = [load_batch(ds, mb) for r in range(dp) for mb in rank_share(ids, r, dp, microbatches)]
        for part, full in zip(zip(*shares, strict=True), whole, strict=True):
            assert torch.equal(torch.cat(part), full)  # the ranks' shares concatenate to the global batch


def test_a_mixture_draws_each_source_by_its_weight(prepared):
    ds = open_dataset(config({"sources": [{"path": str(prepared / "a"), "weight": 3},
                                          {"path": str(prepared / "b"), "weight": 1}]}))
    drawn = [ds.locate(i) for step in range(250) for i in global_batch_ids(7, step, 16, ds.num_samples)]
    share_a = sum(k == 0 for k, _ in drawn) / len(drawn)
    assert 0.72 < share_a < 0.78  # 4000 draws: 0.75 within 3 standard deviations (0.007 each)
    assert all(0 <= j < ds.parts[k].num_samples for k, j in drawn)
    for k, part in enumerate(ds.parts):  # the ids of source k's range map onto all its samples, in order
        lo, hi, n = ds.bounds[k], ds.bounds[k + 1], part.num_samples
        firsts = [lo + -(-j * (hi - lo) // n) for j in range(n)]  # the first id mapping to each sample
        assert [ds.locate(i) for i in firsts] == [(k, j) for j in range(n)]
        assert all(ds.locate(i - 1) == (k, j - 1) for j, i in enumerate(firsts) if j)
        assert torch.equal(ds.sample(firsts[-1]), part.sample(n - 1))


def test_a_mixture_validates_on_each_sources_held_out_tail(prepared):
    spec = {"sources": [{"path": str(prepared / "a"), "weight": 1}, {"path": str(prepared / "b"), "weight": 1}]}
    train, val = open_dataset(config(spec, 5)), open_dataset(config(spec, 5), "val")
    for t, v in zip(train.parts, val.parts, strict=True):
        total = json.loads((prepared / t.source.split("/")[-1] / "manifest.json").read_text())["tokens"]
        assert len(t.tokens) + len(v.tokens) == total and len(v.tokens) == total - int(total * 0.95)
    sources = [val.locate(i)[0] for batch in validation_batches(config(spec, 5), val.num_samples) for i in batch]
    assert sources.count(0) == sources.count(1) == len(sources) // 2


def test_masked_targets_are_ignored_and_counted_targets_follow_the_mask(prepared):
    ds = open_dataset(config({"path": str(prepared / "chat")}))
    ids = global_batch_ids(7, 0, 8, ds.num_samples)
    inputs, targets = load_batch(ds, ids)
    mask = torch.stack([ds.target_mask(i) for i in ids])
    assert torch.equal(targets == IGNORE, ~mask) and 0 < int(mask.sum()) < mask.numel()
    assert torch.equal(targets[mask], torch.stack([ds.sample(i)[1:] for i in ids])[mask])
    assert counted_targets(ds, ids) == int(mask.sum())
    prompt_only = next(i for i in range(ds.num_samples) if not ds.target_mask(i).any())
    assert counted_targets(ds, [prompt_only]) == 0  # the trainer divides by max(1, count)
    plain = open_dataset(config({"path": str(prepared / "a")}))
    assert counted_targets(plain, ids) == 8 * 16 and (load_batch(plain, ids)[1] != IGNORE).all()


def test_a_mixture_needs_no_path(prepared):
    plan = make_plan(config({"sources": [{"path": str(prepared / "a")}]}))
    assert plan.config.data.sources[0].weight == 1.0


def broken(root, tmp_path, what):
    d = tmp_path / what
    shutil.copytree(root / "a", d)
    (d / {"manifest": "manifest.json", "tokenizer": "tokenizer.json", "shard": "tokens-00001.bin"}[what]).unlink()
    return d


def edited(root, tmp_path, change):
    """A copy of directory a whose manifest.json is change(its JSON)."""
    d = tmp_path / "edited"
    shutil.copytree(root / "a", d)
    (d / "manifest.json").write_text(json.dumps(change(json.loads((d / "manifest.json").read_text()))))
    return d


@pytest.mark.parametrize("data,field,message", [
    (lambda r, t: {"path": str(t / "nowhere")}, "data.path", "file not found"),
    (lambda r, t: {"path": str(broken(r, t, "manifest"))}, "data.path", "without manifest.json"),
    (lambda r, t: {"kind": "text", "path": str(r / "a")}, "data.path", "is a directory; data.kind: text reads one"),
    (lambda r, t: {"path": str(broken(r, t, "tokenizer"))}, "data.path", "has no tokenizer.json"),
    (lambda r, t: {"path": str(broken(r, t, "shard"))}, "data.path", "tokens-00001.bin is missing"),
    (lambda r, t: {"path": str(edited(r, t, lambda m: [m]))}, "data.path", "not a trainyard-tokens v1 manifest"),
    (lambda r, t: {"path": str(edited(r, t, lambda m: {**m, "shards": [{}]}))}, "data.path",
     r"manifest.json: shards\[0\] is not \{file, tokens"),
    (lambda r, t: {"sources": [{"path": str(r / "a")}, {"path": str(t / "nowhere")}]}, "data.sources.1.path",
     "file not found"),
    (lambda r, t: {"path": str(r / "a"), "sources": [{"path": str(r / "b")}]}, "data.sources", "not both"),
    (lambda r, t: {"path": str((t / "empty.bin", (t / "empty.bin").write_bytes(b""))[0])}, "data.path",
     "holds too few tokens"),
])
def test_unusable_data_is_an_error_naming_its_field(prepared, tmp_path, data, field, message):
    with pytest.raises(DatasetError, match=message) as info:
        open_dataset(config(data(prepared, tmp_path)))
    assert info.value.field == field


def test_a_vocabulary_above_the_models_or_another_tokenizer_is_an_error(prepared, tmp_path):
    with pytest.raises(DatasetError, match="vocabulary of 300 ids, more than model.vocab_size=256") as info:
        open_dataset(config({"path": str(prepared / "a")}, vocab_size=256))
    assert info.value.field == "data.path"
    (tmp_path / "w.txt").write_text("w1 w2 w3 " * 20)
    prepare([tmp_path / "w.txt"], tmp_path / "w", word_tokenizer(tmp_path / "wtok", 300), progress=False)
    with pytest.raises(DatasetError, match="another tokenizer") as info:
        open_dataset(config({"sources": [{"path": str(prepared / "a")}, {"path": str(tmp_path / "w")}]}))
    assert info.value.field == "data.sources.1.path"
    with pytest.raises(DatasetError, match="another tokenizer") as info:
        open_dataset(config({"path": str(prepared / "a"), "val_path": str(tmp_path / "w")}, 5), "val")
    assert info.value.field == "data.val_path"
    assert open_dataset(config({"path": str(prepared / "b"), "val_path": str(prepared / "a")}, 5), "val").manifest
