"""The model export streamed from the checkpoint (`parallel.io.export`, `parallel.io.stream_safetensors`): the same
file contents as safetensors' own writer of the whole model, a tied pair as two equal tensors, in groups of any
size."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from trainyard.parallel.io.export import export_model, load_exported
from trainyard.parallel.io.stream_safetensors import write_streamed
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.spec import parse_spec


def _config(family: str, tied: bool):
    model = {"family": family, "d_model": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "seq_len": 8,
             "tie_embeddings": tied, **({"n_kv_head": 2} if family == "llama" else {})}
    return parse_spec({"name": "x", "seed": 7, "model": model, "data": {"kind": "synthetic"}, "steps": 1,
                       "global_batch": 1, "resources": {"gpus_per_worker": 0}})


@pytest.mark.parametrize(("family", "tied"), [("llama", False), ("gpt2", True)])
def test_the_streamed_export_holds_the_checkpoints_weights_under_every_name(family, tied, tmp_path):
    config = _config(family, tied)
    model = full_model(config.model, 99)  # other weights than the seed's: the file must hold the checkpoint's
    assert (len(dict(model.named_parameters())) < len(model.state_dict())) == tied  # a tied pair: one parameter
    dcp.save({"model": dict(model.named_parameters())}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    out = export_model(config, tmp_path / "ckpt", 3, tmp_path / "model.safetensors")
    got, want = load_file(str(out)), model.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["step"] == "3" and json.loads(f.metadata()["config"])["family"] == family
    loaded = load_exported(out)  # strict
    assert torch.equal(next(iter(loaded.state_dict().values())), next(iter(want.values())))


def test_groups_of_any_size_write_the_same_bytes(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16(),
               "d": torch.ones(2, 2, dtype=torch.bool)}
    entries = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    files = []
    for group_bytes in (1, 40, 1 << 20):
        path = tmp_path / f"g{group_bytes}.safetensors"
        write_streamed(path, entries, lambda group: [tensors[k] for k, _, _ in group], {"step": "1"}, group_bytes)
        files.append(path.read_bytes())
        assert all(torch.equal(load_file(str(path))[k], t) for k, t in tensors.items())
    assert files[0] == files[1] == files[2]
    with pytest.raises(ValueError, match="the header says"):
        write_streamed(tmp_path / "bad.safetensors", entries, lambda group: [torch.zeros(1) for _ in group], {})
