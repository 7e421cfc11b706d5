"""The Tinker-compatible API's saved state and custom losses through the official Tinker SDK, unchanged, against the
real service (uvicorn, Ray, live training clients' ranks), on a tiny Hugging Face Llama built here.

A client's `save_state` after some steps: a client made from it with its optimizer (`create_training_client_from_state
_with_optimizer`, and the deprecated `load_state_with_optimizer` on a live client) goes on with the very losses of
the uninterrupted one (1e-6); one made from its weights only (`create_training_client_from_state`, `load_state`)
starts at the same loss and then steps as a fresh optimizer does; one at dp2 follows at the data-parallel tests'
tolerance. The checkpoint's adapters, downloaded as a PEFT directory, are peft's own: transformers with them gives
the client's logprobs; `cispo` and `dro` through the SDK are their documented formulas' values. The runs and
checkpoints are listed; another user's path, run and checkpoint answer as missing
ones; bad paths are 422s naming the field without quoting it; a deleted checkpoint is gone. Full fine-tuning saves and
downloads the whole model; a service restart under a live client keeps its saved state (its job FAILED saying why).
`forward_backward_custom` (the SDK's forward, its loss computed locally, a `cross_entropy` with its gradient as
float weights of either sign sent back) steps as the documented linear surrogate does. All slow
(`make test-slow`); the flagship (`test_tinker_sdk.py`) saves and lists once in `make test`."""

from __future__ import annotations

import io
import sqlite3
import tarfile
import warnings

import httpx
import pytest
import torch
from helpers import SLOW
from hf_tiny import tiny_llama
from trainyard.service.tenancy import users

tinker = pytest.importorskip("tinker")
pytestmark = SLOW
ADAM = {"learning_rate": 2e-2}


def _datum(tokens: list[int], weights: list[float] | None = None):
    n = len(tokens) - 1
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                              loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights or [1.0] * n})


def _random_data(seed: int, length: int) -> tuple[list[list[int]], list]:
    """Two sequences of `length` random tokens (drawn from `seed`) and their datums."""
    torch.manual_seed(seed)
    sequences = [torch.randint(0, 256, (length,)).tolist() for _ in range(2)]
    return sequences, [_datum(s) for s in sequences]


def _loop(training, data, steps: int) -> list[float]:
    """`steps` rounds of forward_backward then optim_step; each round's loss, taken before its step."""
    losses = []
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        training.optim_step(tinker.types.AdamParams(**ADAM)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def _logprobs(training, data) -> list[torch.Tensor]:
    return [o["logprobs"].to_torch() for o in training.forward(data, "cross_entropy").result().loss_fn_outputs]


def test_state_saved_through_the_sdk_resumes_lists_downloads_and_stays_its_owners(service, tmp_path):
    root = tmp_path / "alice-data"
    root.mkdir()
    tiny_llama(root / "llama")
    alice = users.create(service.state_dir, "tinker-state-alice", limits=users.Limits(data_roots=(str(root),)))
    bob = users.create(service.state_dir, "tinker-state-bob")
    service.manager.tinker.registered["tinker-state-llama"] = str(root / "llama")
    sequences, data = _random_data(5, 17)
    sc = tinker.ServiceClient(base_url=service.url, api_key="tml-" + alice)
    rest = tinker.RestClient(base_url=service.url, api_key="tml-" + alice)
    http = httpx.Client(base_url=service.url, timeout=60, headers={"X-API-Key": "tml-" + alice})

    def unload(training) -> None:
        assert http.post("/api/v1/unload_model", json={"model_id": training.model_id}).status_code == 200

    a = sc.create_lora_training_client(base_model="tinker-state-llama", rank=4).result()
    _loop(a, data, 2)
    path = a.save_state("two", user_metadata={"note": "after two steps"}).result().path
    assert path == f"tinker://{a.model_id}/weights/two"
    uninterrupted = _loop(a, data, 3)
    unload(a)

    [listed] = rest.list_checkpoints(a.model_id).result().checkpoints
    assert (listed.checkpoint_id, listed.checkpoint_type, listed.tinker_path) == ("weights/two", "training", path)
    assert listed.user_metadata == {"note": "after two steps"} and listed.size_bytes > 0
    run = rest.get_training_run(a.model_id).result()
    assert run.last_checkpoint.tinker_path == path and run.lora_rank == 4 and run.base_model == "tinker-state-llama"
    assert a.model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    assert path in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.lora_rank, info.is_lora) == ("tinker-state-llama", 4, True)

    # With its optimizer: the very losses of the client that saved it, made anew or loaded into a live client.
    c = sc.create_training_client_from_state_with_optimizer(path).result()
    assert _loop(c, data, 3) == pytest.approx(uninterrupted, abs=1e-6)
    d = sc.create_lora_training_client(base_model="tinker-state-llama", rank=4).result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the SDK's deprecation of load_state*: still served
        d.load_state(path).result()
        assert d.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(uninterrupted[0],
                                                                                              abs=1e-6)
        d.load_state_with_optimizer(path).result()
    assert _loop(d, data, 3) == pytest.approx(uninterrupted, abs=1e-6)

    # forward_backward_custom: a loss whose gradient has either sign, sent back as cross_entropy's weights; the
    # same step as that surrogate sent by hand on a client in the same state.
    def custom(_data, logprobs):
        loss = sum(((lp + 5.5) ** 2).sum() for lp in logprobs)
        return loss, {"custom:sum": float(loss.detach())}

    before = _logprobs(c, data)
    out = c.forward_backward_custom(data, custom).result()
    c.optim_step(tinker.types.AdamParams(**ADAM)).result()
    expected = float(sum(((lp + 5.5) ** 2).sum() for lp in before))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5) == out.metrics["custom:sum"]
    weights = [(-2 * (lp + 5.5)).tolist() for lp in _logprobs(d, data)]
    assert min(min(w) for w in weights) < 0 < max(max(w) for w in weights)
    d.forward_backward([_datum(s, w) for s, w in zip(sequences, weights, strict=True)], "cross_entropy").result()
    d.optim_step(tinker.types.AdamParams(**ADAM)).result()
    after = _logprobs(c, data)
    for x, y in zip(after, _logprobs(d, data), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert not torch.allclose(after[0], before[0])
    # A name in use is refused unless overwritten; a bad name or TTL is a 422 naming the field, unquoted.
    c.save_state("mine").result()
    again = {"model_id": c.model_id, "path": "mine", "seq_id": 99}
    assert http.post("/api/v1/save_weights", json=again).json()["detail"][0]["field"] == "path"
    for body, field in (({"path": "../secret"}, "path"), ({"path": "ok", "ttl_seconds": 10}, "ttl_seconds")):
        refused = http.post("/api/v1/save_weights", json={"model_id": c.model_id, **body})
        assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == field
        assert "secret" not in refused.text
    overwritten = c.save_state("mine", overwrite=True).result().path
    assert [x.tinker_path for x in rest.list_checkpoints(c.model_id).result().checkpoints] == [overwritten]
    unload(c)
    unload(d)

    # Weights only: the same adapters (the PEFT download is peft's own form of them), then a fresh optimizer's step.
    b = sc.create_training_client_from_state(path).result()
    mine = _logprobs(b, data)
    tar = http.get(f"/api/v1/training_runs/{a.model_id}/checkpoints/weights/two/peft")
    assert tar.status_code == 200
    tarfile.open(fileobj=io.BytesIO(tar.content)).extractall(tmp_path / "peft", filter="data")
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    reference = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(root / "llama"), tmp_path / "peft").eval()
    with torch.no_grad():
        ids = torch.tensor(sequences)
        theirs = torch.log_softmax(reference(input_ids=ids).logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])
    for row, lp in zip(theirs[..., 0], mine, strict=True):
        torch.testing.assert_close(lp, row, rtol=0, atol=1e-5)
    # cispo and dro through the SDK's wire (their loss_fn_config too): the documented formulas' values.
    sampled = mine[0] + 0.3 * torch.randn(len(mine[0]))
    adv = torch.randn(len(mine[0]))
    rl = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(sequences[0][:-1]),
                             loss_fn_inputs={"target_tokens": sequences[0][1:], "logprobs": sampled.tolist(),
                                             "advantages": adv.tolist()})]
    ratio = torch.exp(mine[0] - sampled)
    narrow = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    for loss_fn, config, value in (("cispo", None, -(ratio.clamp(0.0, 4.0) * mine[0] * adv).sum()),
                                   ("cispo", narrow, -(ratio.clamp(0.9, 1.1) * mine[0] * adv).sum()),
                                   ("dro", {"beta": 0.5}, -(mine[0] * adv - 0.25 * (mine[0] - sampled) ** 2).sum())):
        out = b.forward(rl, loss_fn, config).result()
        assert out.metrics["loss:sum"] == pytest.approx(float(value), rel=1e-5, abs=1e-5), loss_fn
    with pytest.raises(tinker.RequestFailedError, match=r"loss_fn_config\.beta"):
        b.forward(rl, "dro").result()
    fresh = _loop(b, data, 3)
    assert fresh[0] == pytest.approx(uninterrupted[0], abs=1e-6)
    assert fresh[1] != pytest.approx(uninterrupted[1], abs=1e-4)  # its optimizer began afresh
    unload(b)

    # At another layout (dp2), from the dp1 checkpoint: the losses the data-parallel tests hold dp2 to.
    e = sc.create_training_client_from_state_with_optimizer(path, user_metadata={"trainyard_parallel": '{"dp": 2}'})
    assert _loop(e.result(), data, 3) == pytest.approx(uninterrupted, rel=1e-4)
    unload(e.result())

    # Another user: the path, the run and its checkpoint answer as missing ones, and nothing changes.
    other_sc = tinker.ServiceClient(base_url=service.url, api_key="tml-" + bob)
    other = tinker.RestClient(base_url=service.url, api_key="tml-" + bob)
    with pytest.raises(tinker.NotFoundError):
        other_sc.create_training_client_from_state(path).result()
    for call in (lambda: other.list_checkpoints(a.model_id), lambda: other.get_training_run(a.model_id),
                 lambda: other.delete_checkpoint_from_tinker_path(path),
                 lambda: other.get_weights_info_by_tinker_path(path)):
        with pytest.raises(tinker.NotFoundError):
            call().result()
    assert a.model_id not in [r.training_run_id for r in other.list_training_runs().result().training_runs]
    as_bob = httpx.get(f"{service.url}/api/v1/training_runs/{a.model_id}/checkpoints/weights/two/peft",
                       headers={"X-API-Key": "tml-" + bob}, timeout=60)
    assert as_bob.status_code == 404 and as_bob.json()["field"] == "checkpoint_id"

    # Bad paths and names: a 422 naming the field, never quoting what was sent.
    session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {},
                                                         "sdk_version": "x"}).json()["session_id"]
    for bad in ("tinker://secret-run/../weights", "tinker://secret-run/sampler_weights/x", "secret-path"):
        refused = http.post("/api/v1/load_weights", json={"session_id": session, "model_seq_id": 7, "path": bad,
                                                          "optimizer": False})
        assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == "path"
        assert "secret" not in refused.text
    refused = http.delete("/api/v1/training_runs/secret run/checkpoints/weights/two")
    assert refused.status_code == 422 and "secret" not in refused.text
    assert [c.tinker_path for c in rest.list_checkpoints(a.model_id).result().checkpoints] == [path]

    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(a.model_id).result().checkpoints == []
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(path).result()
    http.close()


def test_full_fine_tuning_through_the_sdk_saves_the_whole_model(service, tmp_path):
    """trainyard's extension `trainyard_full_finetune`: a client trains every weight (the SDK's get_info says it is
    not LoRA), its checkpoint downloads as the whole model's Hugging Face directory, which transformers loads to the
    client's own logprobs, and a client made from it is a full fine-tuning again, at the same loss."""
    from transformers import LlamaForCausalLM

    tiny_llama(tmp_path / "llama")
    token = users.create(service.state_dir, "tinker-full-erin")
    service.manager.tinker.registered["tinker-full-llama"] = str(tmp_path / "llama")
    sequences, data = _random_data(6, 13)
    sc = tinker.ServiceClient(base_url=service.url, api_key="tml-" + token)
    http = httpx.Client(base_url=service.url, timeout=60, headers={"X-API-Key": "tml-" + token})
    refused = http.post("/api/v1/create_model", json={"session_id": "s", "base_model": "tinker-full-llama",
                                                      "user_metadata": {"trainyard_full_finetune": "yes"}})
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["field"] == "user_metadata.trainyard_full_finetune"

    full = sc.create_lora_training_client(base_model="tinker-full-llama", rank=4,
                                          user_metadata={"trainyard_full_finetune": "true"}).result()
    info = full.get_info()
    assert (info.is_lora, info.lora_rank) == (False, None)
    losses = _loop(full, data, 3)
    assert losses[-1] < losses[0]
    path = full.save_state("three").result().path
    mine = _logprobs(full, data)
    tar = http.get(f"/api/v1/training_runs/{full.model_id}/checkpoints/weights/three/peft")
    assert tar.status_code == 200
    tarfile.open(fileobj=io.BytesIO(tar.content)).extractall(tmp_path / "hf", filter="data")
    reference = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        for s, lp in zip(sequences, mine, strict=True):
            ids = torch.tensor([s[:-1]])
            theirs = torch.log_softmax(reference(input_ids=ids).logits[0].float(), -1).gather(
                1, torch.tensor(s[1:])[:, None])[:, 0]
            torch.testing.assert_close(lp, theirs, rtol=0, atol=1e-4)
    again = sc.create_training_client_from_state(path).result()
    assert again.get_info().is_lora is False
    assert again.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        float(-sum(lp.sum() for lp in mine)), abs=1e-4)
    for client in (full, again):
        assert http.post("/api/v1/unload_model", json={"model_id": client.model_id}).status_code == 200


def test_a_service_restart_keeps_a_clients_saved_state_and_answers_its_calls_clearly(ray_session, tmp_path):
    """The service dies under a live client (its row left RUNNING, as a crash leaves it) and starts again on the
    same state directory: the client's job is FAILED saying why, its old model id and in-flight request answer as
    missing ones (a 404 naming the field, at once), and its saved state is listed and makes a new client at the
    very loss it was saved at."""
    from conftest import start_service
    from trainyard.actors.state import JobStatus

    tiny_llama(tmp_path / "llama")
    state = tmp_path / "state"
    first = start_service(state)
    token = users.create(state, "tinker-restart-frank")
    first.manager.tinker.registered["tinker-restart-llama"] = str(tmp_path / "llama")
    torch.manual_seed(7)
    data = [_datum(torch.randint(0, 256, (13,)).tolist()) for _ in range(2)]
    try:
        training = tinker.ServiceClient(base_url=first.url, api_key="tml-" + token).create_lora_training_client(
            base_model="tinker-restart-llama", rank=4).result()
        _loop(training, data, 2)
        path = training.save_state("kept").result().path
        at_save = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        with httpx.Client(base_url=first.url, timeout=30, headers={"X-API-Key": "tml-" + token}) as http:
            in_flight = http.post("/api/v1/optim_step", json={"model_id": training.model_id,
                                                              "adam_params": ADAM}).json()["request_id"]
    finally:
        first.shutdown()
    with sqlite3.connect(state / "jobs.db") as db:  # as a crash leaves it (the store keeps an ended job ended)
        db.execute("UPDATE jobs SET status = ?, error = NULL, ended_at = NULL WHERE job_id = ?",
                   (JobStatus.RUNNING.value, training.model_id))
    second = start_service(state)
    try:
        second.manager.tinker.registered["tinker-restart-llama"] = str(tmp_path / "llama")
        with httpx.Client(base_url=second.url, timeout=30, headers={"X-API-Key": "tml-" + token}) as http:
            job = http.get(f"/api/jobs/{training.model_id}", headers={"Authorization": f"Bearer {token}"}).json()
            assert job["status"] == "FAILED" and "restarted" in job["error"]
            gone = http.post("/api/v1/get_info", json={"model_id": training.model_id})
            assert gone.status_code == 404
            assert http.post("/api/v1/retrieve_future", json={"request_id": in_flight}).status_code == 404
        sc = tinker.ServiceClient(base_url=second.url, api_key="tml-" + token)
        rest = tinker.RestClient(base_url=second.url, api_key="tml-" + token)
        assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [path]
        again = sc.create_training_client_from_state_with_optimizer(path).result()
        assert again.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, abs=1e-6)
    finally:
        second.shutdown()
