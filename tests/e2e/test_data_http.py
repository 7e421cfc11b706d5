"""Submitting a spec whose prepared data cannot train the model: a 422 naming the field, and no job created."""

import shutil

import pytest
from data_helpers import bpe_tokenizer
from helpers import REPO, tiny_spec
from trainyard.parallel.data.prepare import prepare


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    prepare([REPO / "examples" / "corpus.txt"], root / "corpus", bpe_tokenizer(root / "tok"), progress=False)
    for part in ("manifest.json", "tokenizer.json"):
        shutil.copytree(root / "corpus", root / f"no-{part}")
        (root / f"no-{part}" / part).unlink()
    return root


@pytest.mark.parametrize("data,vocab,field,text", [
    ({"path": "corpus"}, 256, "data.path", "vocabulary of 300 ids, more than model.vocab_size=256"),
    ({"path": "no-manifest.json"}, 300, "data.path", "without manifest.json"),
    ({"path": "no-tokenizer.json"}, 300, "data.path", "has no tokenizer.json"),
    ({"sources": [{"path": "corpus"}, {"path": "missing"}]}, 300, "data.sources.1.path", "no such file or directory"),
])
def test_unusable_prepared_data_is_a_422_naming_the_field_and_creates_no_job(client, corpus, data, vocab, field,
                                                                            text):
    data = {"kind": "tokens", "path": str(corpus / data["path"])} if "path" in data else \
        {"kind": "tokens", "path": None, "sources": [{"path": str(corpus / s["path"])} for s in data["sources"]]}
    before = len(client.jobs())
    response = client._http.post("/api/jobs", json=tiny_spec(model={"vocab_size": vocab}, data=data))
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert any(d["field"] == field and text in d["msg"] for d in detail), detail
    assert len(client.jobs()) == before
