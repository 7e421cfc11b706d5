"""Sampling through the official Tinker SDK against the real service (`make test-slow`): a LoRA training client of a
tiny Hugging Face Llama takes a few steps, then samples at its save point, and the reference is transformers on the
same weights, taken out of the client's rank as a finished job's are (its checkpoint, `export_model`, `export_hf`:
the adapters merged). Greedy samples (temperature 0, and top_k 1) are transformers' `generate` token for token;
sampled tokens' logprobs and compute_logprobs are transformers' forward's (1e-5), and the training client's
forward's; a seed reproduces its sequences; a stop token ends a sequence with stop_reason "stop"; a sampler at an
earlier save point samples its own weights while training goes on from the live ones; `await sample(...)` serves
too; a base model's sampler (no training client) is the base model. Bad SamplingParams are 422s naming the field;
another user's sampler, one whose unnamed weights were dropped for newer ones, or one whose training client was
unloaded, answers as missing."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray
import torch
from helpers import slow
from hf_tiny import tiny_llama
from trainyard.parallel.runtime.sampling.params import MAX_EPHEMERAL
from trainyard.service.tenancy import users

tinker = pytest.importorskip("tinker")
T = tinker.types


def _datum(tokens: list[int]):
    return T.Datum(model_input=T.ModelInput.from_ints(tokens[:-1]),
                   loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _trained_reference(model_id: str, steps: int, tmp_path):
    """transformers' model of the client's weights now: its rank's checkpoint, exported as a job's model is."""
    from trainyard.parallel.io.checkpoint import step_dir
    from trainyard.parallel.io.export import export_hf
    from transformers import AutoModelForCausalLM

    rank = ray.get_actor(f"trainyard/tinker-{model_id}/pp0-tp0-dp0")
    ray.get(rank.final_checkpoint.remote(str(tmp_path / "ckpt"), steps, {}, False))
    exported = ray.get(rank.export_model.remote(str(step_dir(tmp_path / "ckpt", steps)), steps,
                                                str(tmp_path / "model.safetensors")))
    model = AutoModelForCausalLM.from_pretrained(export_hf(exported, tmp_path / "hf")).eval()
    model.generation_config.eos_token_id = None  # stop=[] below: only max_tokens ends a sequence
    return model


def _logprobs(model, tokens: list[int]) -> torch.Tensor:
    """Each position's logprob of the token after it."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
    return lp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def _generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


@slow
def test_sampling_a_trained_client_through_the_official_sdk(service, tmp_path):
    tiny_llama(tmp_path / "llama")
    service.manager.tinker.registered["tinker-sampling-llama"] = str(tmp_path / "llama")
    alice, bob = (users.create(service.state_dir, f"sampling-{n}") for n in ("alice", "bob"))
    client = tinker.ServiceClient(base_url=service.url, api_key="tml-" + alice)
    training = client.create_lora_training_client(base_model="tinker-sampling-llama", rank=4).result()
    torch.manual_seed(3)
    sequences = [torch.randint(0, 256, (17,)).tolist() for _ in range(2)]
    adam = T.AdamParams(learning_rate=2e-2)
    for _ in range(3):
        training.forward_backward([_datum(s) for s in sequences], "cross_entropy")
        training.optim_step(adam).result()
    saved = training.save_weights_for_sampler("step-3").result().path
    assert saved == f"tinker://{training.model_id}/sampler_weights/step-3"
    sampler = training.create_sampling_client(saved).result()
    assert sampler.get_base_model() == "tinker-sampling-llama"
    trained = _trained_reference(training.model_id, 3, tmp_path)
    prompt, ids = T.ModelInput.from_ints(sequences[0][:6]), sequences[0][:6]

    expected = _generate(trained, ids, 10)
    for params in (T.SamplingParams(max_tokens=10, temperature=0.0, stop=[]),
                   T.SamplingParams(max_tokens=10, top_k=1, stop=[], seed=5)):
        out = sampler.sample(prompt, 2, params).result()
        assert [s.tokens for s in out.sequences] == [expected] * 2
        assert [s.stop_reason for s in out.sequences] == ["length"] * 2
        torch.testing.assert_close(torch.tensor(out.sequences[0].logprobs), _logprobs(trained, ids + expected)[5:],
                                   rtol=0, atol=1e-5)

    seeded = T.SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=11, stop=[])
    first = sampler.sample(prompt, 3, seeded).result()
    assert [s.tokens for s in sampler.sample(prompt, 3, seeded).result().sequences] == \
        [s.tokens for s in first.sequences]  # the same seed: the same sequences
    for s in first.sequences:  # each sampled token's logprob, under the model's own distribution
        torch.testing.assert_close(torch.tensor(s.logprobs), _logprobs(trained, ids + s.tokens)[5:], rtol=0,
                                   atol=1e-5)

    stop_at = max(expected.index(t) for t in expected)  # a token's first place: the latest one
    stopped = sampler.sample(prompt, 1, T.SamplingParams(max_tokens=10, temperature=0.0,
                                                         stop=[expected[stop_at]])).result().sequences[0]
    assert (stopped.tokens, stopped.stop_reason) == (expected[:stop_at + 1], "stop")

    scored = sampler.compute_logprobs(T.ModelInput.from_ints(sequences[1])).result()
    forward = training.forward([_datum(sequences[1])], "cross_entropy").result()
    torch.testing.assert_close(torch.tensor(scored[1:]), _logprobs(trained, sequences[1]), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(scored[1:]), forward.loss_fn_outputs[0]["logprobs"].to_torch(), rtol=0,
                               atol=1e-5)
    top = sampler.sample(prompt, 1, T.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                         topk_prompt_logprobs=3).result()
    assert top.prompt_logprobs[0] is None and top.topk_prompt_logprobs[0] is None
    for row, lp in zip(top.topk_prompt_logprobs[1:], _logprobs(trained, ids), strict=True):
        assert len(row) == 3 and row[0][1] >= lp.item() - 1e-5

    # Training goes on from the live weights; the sampler keeps its save point's, and `await sample` serves it.
    training.forward_backward([_datum(s) for s in sequences], "cross_entropy")
    training.optim_step(adam).result()

    async def greedy_async():
        return await sampler.sample(prompt, 1, T.SamplingParams(max_tokens=10, temperature=0.0, stop=[]))

    assert asyncio.run(greedy_async()).sequences[0].tokens == expected
    later = training.save_weights_and_get_sampling_client().result()
    assert later.compute_logprobs(T.ModelInput.from_ints(sequences[1])).result()[1:] != scored[1:]

    base = client.create_sampling_client(base_model="tinker-sampling-llama").result()  # a rank of its own
    reference = tiny_llama(tmp_path / "again").eval()  # the same seed: the base model's weights
    reference.generation_config.eos_token_id = None
    assert base.sample(prompt, 1, T.SamplingParams(max_tokens=10, temperature=0.0, stop=[])).result() \
        .sequences[0].tokens == _generate(reference, ids, 10)

    with httpx.Client(base_url=service.url, timeout=60) as http:
        as_alice, as_bob = ({"X-API-Key": "tml-" + who} for who in (alice, bob))
        request = {"sampling_session_id": sampler._sampling_session_id, "num_samples": 1,
                   "prompt": {"chunks": [{"type": "encoded_text", "tokens": ids}]}, "sampling_params": {}}
        for params, field in (({"max_tokens": 0}, "sampling_params.max_tokens"),
                              ({"max_tokens": 100}, "sampling_params.max_tokens"),
                              ({"temperature": -0.5}, "sampling_params.temperature"),
                              ({"top_k": 0}, "sampling_params.top_k"), ({"seed": -3}, "sampling_params.seed"),
                              ({"stop": [9999]}, "sampling_params.stop"), ({"stop": ["\n"]}, "sampling_params.stop"),
                              ({"temperature": "hot"}, "sampling_params.temperature")):
            bad = http.post("/api/v1/asample", headers=as_alice, json=request | {"sampling_params": params})
            assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == field, (params, bad.text)
        assert http.post("/api/v1/asample", headers=as_alice,
                         json=request | {"num_samples": 0}).json()["detail"][0]["field"] == "num_samples"
        assert http.post("/api/v1/asample", headers=as_bob, json=request).status_code == 404
        assert http.get(f"/api/v1/samplers/{sampler._sampling_session_id}", headers=as_bob).status_code == 404
        assert http.get(f"/api/v1/samplers/{sampler._sampling_session_id}", headers=as_alice).json()[
            "model_path"] == saved
        assert http.post("/api/v1/save_weights_for_sampler", headers=as_bob,
                         json={"model_id": training.model_id, "path": "x"}).status_code == 404
        assert http.post("/api/v1/save_weights_for_sampler", headers=as_alice,
                         json={"model_id": training.model_id, "path": "../x"}).json()["detail"][0]["field"] == "path"
        unnamed = [training.save_weights_and_get_sampling_client().result() for _ in range(MAX_EPHEMERAL)]
        dropped, kept = (request | {"sampling_session_id": s._sampling_session_id, "sampling_params": {"max_tokens": 2}}
                         for s in (later, unnamed[0]))  # a client keeps its last MAX_EPHEMERAL unnamed ones
        assert http.post("/api/v1/asample", headers=as_alice, json=dropped).status_code == 404
        assert http.post("/api/v1/asample", headers=as_alice, json=kept).status_code == 200
        assert http.post("/api/v1/unload_model", headers=as_alice,
                         json={"model_id": training.model_id}).status_code == 200
        gone = http.post("/api/v1/asample", headers=as_alice, json=request | {"sampling_params": {"max_tokens": 2}})
        assert gone.status_code == 404
