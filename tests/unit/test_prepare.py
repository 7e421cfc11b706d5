"""`trainyard prepare`: JSONL, Parquet and text to token shards with a manifest; a rerun is a no-op; chat masks."""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from data_helpers import EOS, bpe_tokenizer, word_tokenizer
from helpers import REPO, wait_for
from tokenizers import Tokenizer
from trainyard.cli.main import main
from trainyard.parallel.data.prepare import PrepareError, PrepareOptions, prepare
from trainyard.parallel.data.token_dir import Manifest, file_sha256

DOCS = ["The hump engine pushes the cars.", "Every car has a number.", "Trains leave on time, every day."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok"))


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" + ("\n" if i == 0 else "")
                            for i, d in enumerate(docs)))
    return path


def stream(directory, manifest):
    return np.concatenate([np.fromfile(directory / s["file"], dtype=manifest.dtype) for s in manifest.shards])


def expected_stream(tokenizer_dir, docs):
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    return [t for d in docs for t in [*tok.encode(d, add_special_tokens=False).ids, eos]], eos


def test_prepare_jsonl_writes_shards_the_manifest_and_the_tokenizer(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "ds"
    result = prepare([src], out, tokenizer, PrepareOptions(shard_tokens=10), progress=False)
    m = Manifest.read(out)
    assert not result.skipped and m == result.manifest
    want, eos = expected_stream(tokenizer, DOCS)
    assert stream(out, m).tolist() == want  # documents in order, each followed by EOS, across shards
    assert (m.documents, m.tokens, m.eos_id, m.dtype, m.counted_tokens) == (3, len(want), eos, "uint16", None)
    assert len(m.shards) == -(-len(want) // 10) and [s["tokens"] for s in m.shards][:-1] == [10] * (len(m.shards) - 1)
    for s in m.shards:
        assert (out / s["file"]).stat().st_size == s["bytes"] == 2 * s["tokens"]
        assert file_sha256(out / s["file"]) == s["sha256"]
    assert (out / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert m.tokenizer["sha256"] == file_sha256(tokenizer / "tokenizer.json")
    assert (out / "tokenizer_config.json").is_file() and m.vocab_size == 300
    assert m.inputs == [{"path": str(src.resolve()), "bytes": src.stat().st_size, "sha256": file_sha256(src)}]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_prepare_parquet_reads_its_column_like_jsonl_reads_its_field(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS, "n": [1, 2, 3]}), tmp_path / "docs.parquet")
    write_jsonl(tmp_path / "docs.jsonl", DOCS, field="body")
    a = prepare([tmp_path / "docs.parquet"], tmp_path / "a", tokenizer, PrepareOptions(column="body"),
                progress=False).manifest
    b = prepare([tmp_path / "docs.jsonl"], tmp_path / "b", tokenizer, PrepareOptions(field="body"),
                progress=False).manifest
    assert stream(tmp_path / "a", a).tolist() == stream(tmp_path / "b", b).tolist() == expected_stream(tokenizer,
                                                                                                        DOCS)[0]
    with pytest.raises(PrepareError, match="no column 'text'"):
        prepare([tmp_path / "docs.parquet"], tmp_path / "c", tokenizer, progress=False)


def test_a_second_prepare_is_a_noop_and_a_changed_input_prepares_again(tmp_path, tokenizer, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "ds"
    args = ["prepare", str(src), "-o", str(out), "--tokenizer", str(tokenizer), "--workers", "1"]
    assert main(args) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing rewritten
    (out / "tokens-00000.bin").write_bytes(b"")  # damaged since: prepared again
    assert not prepare([src], out, tokenizer, progress=False).skipped
    write_jsonl(src, DOCS + ["A new document."])
    result = prepare([src], out, tokenizer, progress=False)
    assert not result.skipped and result.manifest.documents == 4
    assert stream(out, result.manifest).tolist() == expected_stream(tokenizer, DOCS + ["A new document."])[0]
    other = prepare([src], out, tokenizer, PrepareOptions(shard_tokens=7), progress=False)
    assert not other.skipped and other.manifest.fingerprint != result.manifest.fingerprint  # options count too


def test_workers_do_not_change_the_output(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS * 50)  # several batches, so the pool interleaves them
    one = prepare([src], tmp_path / "one", tokenizer, progress=False).manifest
    two = prepare([src], tmp_path / "two", tokenizer, workers=2, progress=False).manifest
    assert one.shards == two.shards and one.fingerprint == two.fingerprint and one.documents == 150


def test_a_vocabulary_beyond_uint16_gets_uint32_shards(tmp_path):
    tok = word_tokenizer(tmp_path / "tok", 70_000)
    (tmp_path / "a.txt").write_text("w69998 w5 w65536")
    m = prepare([tmp_path / "a.txt"], tmp_path / "ds", tok, progress=False).manifest
    assert (m.dtype, m.vocab_size, m.eos_id) == ("uint32", 70_000, 69_999)
    assert np.fromfile(tmp_path / "ds" / m.shards[0]["file"], np.uint32).tolist() == [69998, 5, 65536, 69999]


@pytest.mark.parametrize("eos_id,dtype", [(65_535, "uint16"), (65_536, "uint32")])
def test_a_vocabulary_with_gaps_is_sized_by_its_largest_id(tmp_path, eos_id, dtype):
    tok = word_tokenizer(tmp_path / "tok", 11)  # w0..w9 and EOS, moved to eos_id: 11 tokens, ids up to eos_id
    spec = json.loads((tok / "tokenizer.json").read_text())
    spec["model"]["vocab"][EOS] = eos_id
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "a.txt").write_text("w3 w9")
    m = prepare([tmp_path / "a.txt"], tmp_path / "ds", tok, progress=False).manifest
    assert (m.dtype, m.vocab_size, m.eos_id) == (dtype, eos_id + 1, eos_id)  # every id is below vocab_size
    assert np.fromfile(tmp_path / "ds" / m.shards[0]["file"], dtype).tolist() == [3, 9, eos_id]


def test_chat_records_count_only_completions_and_assistant_turns(tmp_path, tokenizer):
    m = prepare([REPO / "examples" / "finetune.jsonl"], tmp_path / "chat", tokenizer, PrepareOptions(chat=True),
                progress=False).manifest
    ids = np.fromfile(tmp_path / "chat" / m.shards[0]["file"], np.uint16)
    mask = np.fromfile(tmp_path / "chat" / m.shards[0]["mask_file"], np.uint8)
    assert len(mask) == len(ids) == m.tokens and m.counted_tokens == int(mask.sum()) and m.documents == 30
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    ends = np.flatnonzero(ids == m.eos_id)
    records = [json.loads(line) for line in (REPO / "examples" / "finetune.jsonl").read_text().splitlines()]
    for record, start, end in zip(records[:4], [0, *ends[:3] + 1], ends[:4], strict=True):
        counted = tok.decode(ids[start:end + 1][mask[start:end + 1] == 1].tolist(), skip_special_tokens=False)
        whole = tok.decode(ids[start:end + 1].tolist(), skip_special_tokens=False)
        if "completion" in record:
            assert counted == record["completion"] + EOS and whole == record["prompt"] + counted
        else:
            answer = [msg["content"] for msg in record["messages"] if msg["role"] == "assistant"]
            assert counted == "".join(a + "<|end|>\n" for a in answer) + EOS
            assert record["messages"][0]["content"] in whole


def test_chat_messages_without_a_template_and_a_tokenizer_without_eos_are_errors(tmp_path):
    tok = bpe_tokenizer(tmp_path / "tok", config=False)
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(PrepareError, match="give --eos"):
        prepare([src], tmp_path / "a", tok, PrepareOptions(chat=True), progress=False)
    with pytest.raises(PrepareError, match=r"chat\.jsonl:1: messages need a chat template"):
        prepare([src], tmp_path / "a", tok, PrepareOptions(chat=True, eos=EOS), progress=False)
    assert not (tmp_path / "a").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("name,content,chat,match", [
    ("docs.jsonl", b'{"text": "fine"}\n{"body": "no text field"}\n', False, r"docs\.jsonl:2: no string field 'text'"),
    ("web.parquet", b"not parquet", False, r"web\.parquet: not a readable Parquet file"),
    ("docs.txt", b"fine text \xff\xfe more", False, r"docs\.txt: not UTF-8 \(byte 10"),
    ("docs.jsonl", b'{"text": "fine"}\n{"text": "bad \xff"}\n', False, r"docs\.jsonl:2: not UTF-8"),
    ("empty.txt", b"", False, "no document to tokenize"),
    ("empty.jsonl", b'{"text": ""}\n\n', False, "no document to tokenize"),
    ("chat.jsonl", json.dumps({"messages": [{"role": None, "content": "hi"}, {"role": "assistant", "content": "yo"}]})
     .encode(), True, r"chat\.jsonl:1: "),
    ("chat.jsonl", json.dumps({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "yo"}]})
     .encode(), True, r"chat\.jsonl:1: "),  # the template cannot render it
])
def test_an_unusable_input_is_an_error_naming_it_and_leaves_nothing(tmp_path, tokenizer, name, content, chat, match):
    """A bad record (its line), a file that is not Parquet or not UTF-8, inputs with nothing to tokenize."""
    src = tmp_path / name
    src.write_bytes(content)
    with pytest.raises(PrepareError, match=match):
        prepare([src], tmp_path / "ds", tokenizer, PrepareOptions(chat=chat), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.parametrize("record", [{"messages": [{"role": "user", "content": "hi"}]},
                                    {"prompt": "hi", "completion": ""}])
def test_chat_records_with_nothing_counted_in_the_loss_are_prepared_with_a_warning(tmp_path, tokenizer, capsys,
                                                                                     record):
    """Prompts alone make a dataset all of whose targets are masked: of no use to train on, hence the warning,
    but still a dataset (the tests' all-masked batch is one)."""
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps(record) + "\n")
    manifest = prepare([src], tmp_path / "ds", tokenizer, PrepareOptions(chat=True), progress=False).manifest
    assert manifest.counted_tokens == 0 and manifest.tokens > 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "nothing counts in the loss" in err


def test_a_chat_mask_cut_short_is_prepared_again(tmp_path, tokenizer):
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"prompt": "What does green mean?", "completion": "Go."}) + "\n")
    out = tmp_path / "ds"
    first = prepare([src], out, tokenizer, PrepareOptions(chat=True), progress=False).manifest
    mask = out / first.shards[0]["mask_file"]
    mask.write_bytes(mask.read_bytes()[:-1])
    assert not prepare([src], out, tokenizer, PrepareOptions(chat=True), progress=False).skipped
    assert mask.stat().st_size == first.tokens


def test_an_output_inside_the_input_directory_is_not_read_as_input(tmp_path, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(DOCS[0])
    (corpus / ".ds.tmp-1").mkdir()  # an interrupted run's temporary output
    (corpus / ".ds.tmp-1" / "tokens-00000.bin").write_bytes(b"\x00\x01")
    first = prepare([corpus], corpus / "ds", tokenizer, progress=False)
    assert first.manifest.documents == 1
    again = prepare([corpus], corpus / "ds", tokenizer, progress=False)
    assert again.skipped and again.manifest.fingerprint == first.manifest.fingerprint


SLOW_PREPARE = """import sys, time
import trainyard.parallel.data.prepare as p
encode = p._encode_batch
p._encode_batch = lambda batch: (time.sleep(0.05), encode(batch))[1]  # a prepare long enough to stop midway
from trainyard.cli.main import main
sys.exit(main(["prepare", *sys.argv[1:], "--workers", "1"]))
"""


def test_a_stopped_or_killed_prepare_leaves_nothing_behind(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS * 2000)
    run = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE, str(src), "-o", str(tmp_path / "ds"), "--tokenizer",
                            str(tokenizer)], stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    wait_for(lambda: list(tmp_path.glob(".ds.tmp-*/tokens-00000.bin")), 60, "prepare to write its first shard")
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 128 + signal.SIGTERM  # the SIGTERM ended it as Ctrl-C does, not mid-write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    host = socket.gethostname()
    for pid in dead.pid, os.getppid():  # what a SIGKILLed run left, and a running prepare's output in the making
        (tmp_path / f".ds.tmp-{host}-{pid}").mkdir()
        (tmp_path / f".ds.tmp-{host}-{pid}" / "tokens-00000.bin").write_bytes(b"\x00\x01")
    prepare([write_jsonl(tmp_path / "small.jsonl", DOCS)], tmp_path / "ds", tokenizer, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [f".ds.tmp-{host}-{os.getppid()}"]
