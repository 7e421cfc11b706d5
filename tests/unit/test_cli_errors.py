"""The CLI says what is wrong with a file it reads or writes in one `error:` line and exits 2, as it does for
the API's errors: never a Python traceback."""

import json
import math

import httpx
import pytest
from trainyard.cli.client import ApiError, Client
from trainyard.cli.main import main

UNREACHABLE = ["--url", "http://127.0.0.1:9", "--token", "t"]


@pytest.mark.parametrize("command", ["submit", "plan"])
@pytest.mark.parametrize("content, text", [
    (None, "No such file or directory"),
    (b"steps: [1\n", "not valid YAML/JSON"),
    (b"\xff\xfe", "is not UTF-8 text"),
    (b"- 1\n", "a JobSpec must be a mapping of fields"),
    (b"steps: " + b"1" * 5000 + b"\n", "Exceeds the limit (4300 digits)"),  # each of these three was a traceback
    (b"name: 2001-02-30\n", "day is out of range for month"),
    (b"name: " + b"[" * 100_000 + b"\n", "nested too deeply"),
])
def test_an_unusable_spec_file_is_one_error_line(tmp_path, capsys, command, content, text):
    path = tmp_path / "spec.yaml"
    if content is not None:
        path.write_bytes(content)
    assert main([*UNREACHABLE, command, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and text in err and "Traceback" not in err


def test_export_into_a_path_that_is_a_file_is_one_error_line(tmp_path, capsys):
    taken = tmp_path / "model.st"
    taken.write_text("")
    assert main([*UNREACHABLE, "export", "abc", "-o", str(taken)]) == 2
    assert capsys.readouterr().err.startswith("error: [Errno 17] File exists")


def test_a_hugging_face_export_into_a_directory_that_holds_files_is_refused_before_downloading(tmp_path, capsys):
    """transformers loads the whole directory: an earlier export's tokenizer or shards would come with the model."""
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main([*UNREACHABLE, "export", "abc", "--format", "hf", "-o", str(tmp_path)]) == 2  # no server asked
    assert "is not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]


def test_a_spec_with_nan_reaches_the_api_which_names_the_field():
    """httpx's `json=` raised ValueError on NaN (a YAML `.nan`) before anything was sent."""
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))  # Python reads NaN, as the API's parser does
        detail = [{"field": "optimizer.lr", "msg": "Input should be a finite number"}]
        return httpx.Response(422, json={"detail": detail})

    client = Client("http://api", "t")
    client._http = httpx.Client(base_url="http://api", transport=httpx.MockTransport(handler))
    spec = {"model": {"n_layer": 1, "n_head": 1, "d_model": 16}, "steps": 1, "optimizer": {"lr": math.nan}}
    with pytest.raises(ApiError) as info:
        client.submit(spec)
    assert "optimizer.lr" in str(info.value) and "finite" in str(info.value)
    assert math.isnan(sent[0]["optimizer"]["lr"])


@pytest.mark.parametrize("job_id", ["done/../other", "../jobs", ".", "..", "other?x=1", "other#x"])
def test_a_job_id_is_one_path_segment_of_the_request(job_id):
    """The id was put into the path as it was: `trainyard stop done/../other` stopped (and `delete` deleted) the
    job `other`, and `status .` printed the job list."""
    paths = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.raw_path)
        return httpx.Response(404, json={"detail": "no job"})

    client = Client("http://api", "t")
    client._http = httpx.Client(base_url="http://api", transport=httpx.MockTransport(handler))
    for call in (client.job, client.stop, client.delete, client.events):
        with pytest.raises(ApiError):
            call(job_id)
    segments = {path.split(b"?")[0].split(b"/")[3] for path in paths}
    assert len(paths) == 4 and all(p.startswith(b"/api/jobs/") for p in paths)
    assert {httpx.URL(f"http://api/{s.decode()}").path[1:] for s in segments} == {job_id}


def test_an_empty_job_id_is_one_error_line(capsys):
    """`status ''` asked GET /api/jobs/, the job list (or a redirect to it), and printed it as the job."""
    assert main([*UNREACHABLE, "status", ""]) == 2
    assert capsys.readouterr().err == "error: a job id cannot be empty\n"


@pytest.mark.parametrize("option, text", [
    (["--url", "http://[::1", "--token", "t"], "is not a URL of the trainyard API"),
    (["--url", "http://\x00", "--token", "t"], "is not a URL of the trainyard API"),
    (["--url", "http://127.0.0.1:9", "--token", "sécret"], "the token has a non-ASCII character"),
])
def test_a_malformed_url_or_token_is_one_error_line(capsys, option, text):
    """httpx raised InvalidURL or UnicodeEncodeError building the client: a traceback."""
    assert main([*option, "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and text in err and err.count("\n") == 1
