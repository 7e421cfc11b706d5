"""The flagship of the Tinker-compatible API: the official Tinker SDK, unchanged, against the real service (uvicorn,
Ray, a live training client's rank). A tiny Hugging Face Llama directory built here (nothing downloaded) in a user's
data root is the base model; a LoRA training client runs a supervised loop of a few steps: the first
forward_backward's loss and per-token logprobs are transformers' own on the same tokens (1e-5), forward_backward
accumulates until optim_step applies, and the loss falls over the steps; save_state's checkpoint is listed. Another
user's model id and checkpoints answer as missing ones (a 404) through the SDK; bad input is a 422 naming the field;
a rank killed under the client fails the call that meets it at once, the ranks rebuilt from the state it last saved
(an event on its job), and the next call runs at that state's loss. Sampling on the client's rank: a save point
before any step samples transformers' greedy generate token for token, and the trained one's compute_logprobs is the
training forward's. In `make test-slow`: clients at dp2, dp2 with ZeRO-1 and tp2 follow one rank's losses, and sample
its tokens."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
import torch
from helpers import slow, wait_for
from hf_tiny import tiny_llama
from trainyard.service.tenancy import users

tinker = pytest.importorskip("tinker")


def _datum(tokens: list[int]):
    n = len(tokens) - 1
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                              loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})


def _loop(training, data, steps: int, started: bool = False) -> list[float]:
    """`steps` rounds of forward_backward then optim_step (`started`: the first forward_backward ran already, the
    loop begins with its step); each round's loss, taken before its step."""
    adam = tinker.types.AdamParams(learning_rate=2e-2)
    if started:
        training.optim_step(adam).result()
    losses = []
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        training.optim_step(adam).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_an_sl_loop_through_the_official_sdk(service, tmp_path):
    root = tmp_path / "alice-data"
    root.mkdir()
    reference = tiny_llama(root / "llama").eval()
    alice = users.create(service.state_dir, "tinker-alice", limits=users.Limits(data_roots=(str(root),)))
    bob = users.create(service.state_dir, "tinker-bob", limits=users.Limits(data_roots=(str(tmp_path),)))
    torch.manual_seed(0)
    sequences = [torch.randint(0, 256, (17,)).tolist() for _ in range(2)]
    data = [_datum(s) for s in sequences]

    client = tinker.ServiceClient(base_url=service.url, api_key="tml-" + alice)
    service.manager.tinker.registered["tinker-tiny-llama"] = str(root / "llama")  # `serve --base-model NAME=DIR`
    rest = tinker.RestClient(base_url=service.url, api_key="tml-" + alice)
    names = [m.model_name for m in rest.get_server_capabilities().result().supported_models]
    assert "tinker-tiny-llama" in names
    training = client.create_lora_training_client(base_model=str(root / "llama"), rank=4).result()
    base_path = training.save_weights_for_sampler("before-training").result().path  # B = 0: the base's weights

    first = training.forward_backward(data, "cross_entropy").result()
    with torch.no_grad():  # transformers' own loss and logprobs on the same tokens, the adapters' B being zero
        ids = torch.tensor(sequences)
        logits = reference(input_ids=ids).logits[:, :-1].float()
        theirs = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]
        mean_loss = reference(input_ids=ids, labels=ids).loss
    n = ids[:, 1:].numel()
    assert first.metrics["loss:sum"] / n == pytest.approx(float(mean_loss), abs=1e-5)
    for out, row in zip(first.loss_fn_outputs, theirs, strict=True):
        torch.testing.assert_close(out["logprobs"].to_torch(), row, rtol=0, atol=1e-5)

    losses = [first.metrics["loss:sum"], *_loop(training, data, steps=3, started=True)]
    assert losses[-1] < losses[0] - 1.0, losses

    forward = training.forward(data, "cross_entropy").result()  # no gradient kept, no step: twice the same
    assert forward.metrics["loss:sum"] == training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert forward.metrics["loss:sum"] < losses[-1]

    # Sampling on the client's own rank: the save point taken before any step is the base model (its weights
    # swapped in, the trained ones back after): its greedy samples are transformers' generate, token for token.
    prompt = tinker.types.ModelInput.from_ints(sequences[0][:5])
    before = client.create_sampling_client(model_path=base_path).result()
    greedy = before.sample(prompt, 2, tinker.types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result()
    reference.generation_config.eos_token_id = None  # stop=[]: nothing but max_tokens ends either
    with torch.no_grad():
        expected = reference.generate(torch.tensor([sequences[0][:5]]), max_new_tokens=8, do_sample=False)[0, 5:]
    assert [s.tokens for s in greedy.sequences] == [expected.tolist()] * 2
    assert [s.stop_reason for s in greedy.sequences] == ["length"] * 2
    # The trained weights' sampler: compute_logprobs is the training forward's (its first position has none).
    trained = training.save_weights_and_get_sampling_client().result()
    scored = trained.compute_logprobs(tinker.types.ModelInput.from_ints(sequences[0])).result()
    assert scored[0] is None
    torch.testing.assert_close(torch.tensor(scored[1:]), forward.loss_fn_outputs[0]["logprobs"].to_torch(),
                               rtol=0, atol=1e-5)

    # importance_sampling through the SDK: the first logprobs as the sampler's, an advantage of 1 on each token
    sampled = first.loss_fn_outputs[0]["logprobs"].tolist()
    rl = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(sequences[0][:-1]),
                            loss_fn_inputs={"target_tokens": sequences[0][1:], "logprobs": sampled,
                                            "advantages": [1.0] * len(sampled)})
    out = training.forward([rl], "importance_sampling").result()
    now = out.loss_fn_outputs[0]["logprobs"].to_torch()
    assert out.metrics["loss:sum"] == pytest.approx(-float(torch.exp(now - torch.tensor(sampled)).sum()), rel=1e-5)

    # save_state: the run's checkpoint, listed (resuming from it: tests/e2e/test_tinker_state_sdk.py, slow).
    path = training.save_state("after-the-loop").result().path
    assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [path]

    # Another user's model id and checkpoints answer as missing ones, through the SDK and over HTTP alike.
    model_id = training.model_id
    other = tinker.ServiceClient(base_url=service.url, api_key="tml-" + bob)
    from tinker.lib.public_interfaces.training_client import fetch_training_info

    with pytest.raises(tinker.NotFoundError):
        other.holder.run_coroutine_threadsafe(fetch_training_info(other.holder, model_id)).result()
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=service.url, api_key="tml-" + bob).list_checkpoints(model_id).result()
    with httpx.Client(base_url=service.url, timeout=30) as http:
        as_bob = http.post("/api/v1/optim_step", headers={"X-API-Key": "tml-" + bob},
                           json={"model_id": model_id, "adam_params": {"learning_rate": 1e-3}})
        assert as_bob.status_code == 404 and model_id in as_bob.text
        bad = http.post("/api/v1/optim_step", headers={"X-API-Key": "tml-" + alice},
                        json={"model_id": model_id, "adam_params": {"learning_rate": -1}})
        assert bad.status_code == 422 and "learning_rate" in bad.text
        # A base model outside the user's data roots: a 422 naming base_model, the path not quoted back
        session = http.post("/api/v1/create_session", headers={"X-API-Key": "tml-" + bob},
                            json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()["session_id"]
        refused = http.post("/api/v1/create_model", headers={"X-API-Key": "tml-" + bob},
                            json={"session_id": session, "base_model": str(service.state_dir),
                                  "model_seq_id": 0, "lora_config": {"rank": 4}})
        assert refused.status_code == 422 and "base_model" in refused.text
        assert str(service.state_dir) not in refused.text
        # Sampling: another user's sampler weights and sampling session answer as missing; bad params are a 422
        as_bob = http.post("/api/v1/create_sampling_session", headers={"X-API-Key": "tml-" + bob},
                           json={"session_id": session, "sampling_session_seq_id": 0, "model_path": base_path})
        assert as_bob.status_code == 404
        sample = {"sampling_session_id": trained._sampling_session_id, "num_samples": 1,
                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": sequences[0][:5]}]},
                  "sampling_params": {"max_tokens": 4}}
        assert http.post("/api/v1/asample", headers={"X-API-Key": "tml-" + bob}, json=sample).status_code == 404
        bad = http.post("/api/v1/asample", headers={"X-API-Key": "tml-" + alice},
                        json=sample | {"sampling_params": {"max_tokens": 4, "top_p": 0}})
        assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "sampling_params.top_p"
        # A rank that dies under a live client: the call that meets it fails at once, saying the ranks were rebuilt
        # from the state last saved; the next call runs on them, at that state's loss, and the job has the event.
        at_save = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        training.save_state("before-the-kill").result()
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
        ray.kill(ray.get_actor(f"trainyard/tinker-{model_id}/pp0-tp0-dp0"), no_restart=True)
        started = time.monotonic()
        with pytest.raises(Exception, match="rebuilt from the state it last saved"):
            training.forward_backward(data, "cross_entropy").result(timeout=60)
        assert time.monotonic() - started < 60
        again = training.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]
        assert again == pytest.approx(at_save, abs=1e-5)
        bearer = {"Authorization": f"Bearer {alice}"}
        assert http.get(f"/api/jobs/{model_id}", headers=bearer).json()["status"] == "RUNNING"
        assert any(e["kind"] == "tinker_recovered" for e in http.get(f"/api/jobs/{model_id}/events",
                                                                      headers=bearer).json())
        unloaded = http.post("/api/v1/unload_model", headers={"X-API-Key": "tml-" + alice},
                             json={"model_id": model_id})
        assert unloaded.status_code == 200
        assert http.post("/api/v1/get_info", headers={"X-API-Key": "tml-" + alice},
                         json={"model_id": model_id}).status_code == 404


@slow
def test_data_parallel_clients_follow_one_rank(service, tmp_path):
    """trainyard's extension, the layout as a JobSpec's `parallel`: at dp2 (each replica one of the two datums, the
    gradients summed at the step), at dp2 with ZeRO-1 (the optimizer state sharded too) and at tp2, the losses are
    one rank's (1e-4), and so are their samplers' greedy tokens (their first replica samples); tp2's ranks sample
    an unseeded request alike (it would hang otherwise)."""
    tiny_llama(tmp_path / "llama")
    service.manager.tinker.registered["tinker-dp-llama"] = str(tmp_path / "llama")
    token = users.create(service.state_dir, "tinker-carol")
    client = tinker.ServiceClient(base_url=service.url, api_key="tml-" + token)
    torch.manual_seed(1)
    data = [_datum(torch.randint(0, 256, (17,)).tolist()) for _ in range(2)]
    layouts = [None, '{"dp": 2}', '{"dp": 2, "zero": 1}', '{"tp": 2}']
    pending = [client.create_lora_training_client(base_model="tinker-dp-llama", rank=4, user_metadata=None if
                                                  layout is None else {"trainyard_parallel": layout})
               for layout in layouts]
    trainings = [p.result() for p in pending]
    one, *others = [_loop(t, data, steps=4) for t in trainings]
    assert one[-1] < one[0]
    for losses in others:
        assert losses == pytest.approx(one, rel=1e-4)
    greedy = tinker.types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])  # the first rank samples
    prompt = data[0].model_input
    samples = [t.save_weights_and_get_sampling_client().result().sample(prompt, 1, greedy).result().sequences[0]
               for t in trainings]
    assert all(s.tokens == samples[0].tokens for s in samples)
    assert all(s.logprobs == pytest.approx(samples[0].logprobs, abs=1e-4) for s in samples)
    unseeded = tinker.types.SamplingParams(max_tokens=4, temperature=1.0, stop=[])  # tp2's ranks get one seed
    drawn = trainings[-1].save_weights_and_get_sampling_client().result().sample(prompt, 2, unseeded).result()
    assert [len(s.tokens) for s in drawn.sequences] == [4, 4]
    with httpx.Client(base_url=service.url, timeout=30) as http:
        for t in trainings:
            assert http.post("/api/v1/unload_model", headers={"X-API-Key": "tml-" + token},
                             json={"model_id": t.model_id}).status_code == 200
    assert not any(t.model_id in service.manager.tinker.clients for t in trainings)


@slow
def test_a_client_over_its_quota_waits_in_the_queue_and_starts_when_the_first_is_unloaded(service, tmp_path):
    """A training client is a job of kind `tinker` in the service's queue: a user whose quota holds one rank gets
    their first client, and their second waits (the SDK's future pending, the jobs API showing it queued behind
    the quota) instead of failing; unloading the first admits it. A job of theirs would wait alike."""
    from trainyard.cli.client import Client as JobsClient

    tiny_llama(tmp_path / "llama")
    service.manager.tinker.registered["tinker-quota-llama"] = str(tmp_path / "llama")
    token = users.create(service.state_dir, "tinker-dave", limits=users.Limits(max_cpus=1))
    client = tinker.ServiceClient(base_url=service.url, api_key="tml-" + token)
    first = client.create_lora_training_client(base_model="tinker-quota-llama", rank=4).result()
    second = client.create_lora_training_client(base_model="tinker-quota-llama", rank=4)
    jobs = JobsClient(service.url, token)
    wait_for(lambda: len(jobs.jobs()) == 2, 60, "the second client's job row")
    rows = {j["job_id"]: j for j in jobs.jobs()}
    assert rows[first.model_id]["kind"] == "tinker" and rows[first.model_id]["status"] == "RUNNING"
    [queued] = [j for j in rows.values() if j["job_id"] != first.model_id]
    assert queued["status"] == "PENDING" and queued["queue_position"] >= 1
    assert "quota" in queued["waiting_for"]["reason"]
    with httpx.Client(base_url=service.url, timeout=30) as http:
        assert http.post("/api/v1/unload_model", headers={"X-API-Key": "tml-" + token},
                         json={"model_id": first.model_id}).status_code == 200
    admitted = second.result(timeout=120)
    assert admitted.model_id == queued["job_id"]
    torch.manual_seed(2)
    assert admitted.forward_backward([_datum(torch.randint(0, 256, (9,)).tolist())],
                                     "cross_entropy").result().metrics["loss:sum"] > 0
    assert jobs.job(first.model_id)["status"] == "STOPPED" and jobs.job(admitted.model_id)["status"] == "RUNNING"
    jobs.stop(admitted.model_id)  # the jobs API ends a client as its unload does
    assert jobs.job(admitted.model_id)["status"] == "STOPPED"
    assert admitted.model_id not in service.manager.tinker.clients
    jobs.close()
