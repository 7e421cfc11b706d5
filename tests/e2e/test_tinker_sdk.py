"""The flagship of the Tinker-compatible API: the official Tinker SDK, unchanged, against the real service (uvicorn,
Ray, a live training client's rank). A tiny Hugging Face Llama directory built here (nothing downloaded) in a user's
data root is the base model; a LoRA training client runs a supervised loop of a few steps: the first
forward_backward's loss and per-token logprobs are transformers' own on the same tokens (1e-5), forward_backward
accumulates until optim_step applies, and the loss falls over the steps. Another user's model id answers as a
missing one (a 404) through the SDK; bad input is a 422 naming the field."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
import torch
from hf_tiny import tiny_llama
from trainyard.service.tenancy import users

tinker = pytest.importorskip("tinker")


def _datum(tokens: list[int]):
    n = len(tokens) - 1
    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                              loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})


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
    pending = client.create_lora_training_client(base_model=str(root / "llama"), rank=4)
    # trainyard's extension: the layout, as a JobSpec's `parallel` (built beside the first)
    pending_dp2 = client.create_lora_training_client(base_model="tinker-tiny-llama", rank=4,
                                                     user_metadata={"trainyard_parallel": '{"dp": 2, "zero": 1}'})
    training, dp2 = pending.result(), pending_dp2.result()

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

    losses, at_dp2 = [first.metrics["loss:sum"]], [dp2.forward_backward(data, "cross_entropy").result()]
    adam = tinker.types.AdamParams(learning_rate=2e-2)
    training.optim_step(adam).result()
    dp2.optim_step(adam).result()
    for _ in range(3):
        fb, fb2 = training.forward_backward(data, "cross_entropy"), dp2.forward_backward(data, "cross_entropy")
        training.optim_step(adam).result()
        dp2.optim_step(adam).result()
        losses.append(fb.result().metrics["loss:sum"])
        at_dp2.append(fb2.result())
    assert losses[-1] < losses[0] - 1.0, losses
    # dp2 with ZeRO-1 (each replica one of the two datums, the gradients summed at the step, the optimizer state
    # sharded) follows dp1
    assert [out.metrics["loss:sum"] for out in at_dp2] == pytest.approx(losses, rel=1e-4)
    for out, row in zip(at_dp2[0].loss_fn_outputs, theirs, strict=True):
        torch.testing.assert_close(out["logprobs"].to_torch(), row, rtol=0, atol=1e-5)

    forward = training.forward(data, "cross_entropy").result()  # no gradient kept, no step: twice the same
    assert forward.metrics["loss:sum"] == training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert forward.metrics["loss:sum"] < losses[-1]

    # Another user's model id answers as a missing one, through the SDK and over HTTP alike.
    model_id = training.model_id
    other = tinker.ServiceClient(base_url=service.url, api_key="tml-" + bob)
    from tinker.lib.public_interfaces.training_client import fetch_training_info

    with pytest.raises(tinker.NotFoundError):
        other.holder.run_coroutine_threadsafe(fetch_training_info(other.holder, model_id)).result()
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
        # A rank that dies under a live client: the next call fails with a clear error, at once, never a hang.
        ray.kill(ray.get_actor(f"trainyard/tinker-{model_id}/pp0-tp0-dp0"), no_restart=True)
        started = time.monotonic()
        with pytest.raises(Exception, match="died"):
            training.forward_backward(data, "cross_entropy").result(timeout=60)
        assert time.monotonic() - started < 30
        unloaded = http.post("/api/v1/unload_model", headers={"X-API-Key": "tml-" + alice},
                             json={"model_id": model_id})
        assert unloaded.status_code == 404  # released with its rank
        unloaded = http.post("/api/v1/unload_model", headers={"X-API-Key": "tml-" + alice},
                             json={"model_id": dp2.model_id})
        assert unloaded.status_code == 200 and dp2.model_id not in service.manager.tinker.clients
        assert http.post("/api/v1/get_info", headers={"X-API-Key": "tml-" + alice},
                         json={"model_id": model_id}).status_code == 404
