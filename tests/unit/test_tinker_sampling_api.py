"""The sampling clients' pure parts: a sample's result written as the SDK's own reader reads it (tokens, float32
logprobs, stop reasons, prompt logprobs with None where unscored, top-k rows), and the service's sampling sessions:
every id and path is its owner's (another user's answers as missing), a path this service never saved is missing or
malformed (a 422 naming `model_path`), bad params are refused naming the field before any rank is called, and a
sampling session ends with its SDK session."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from trainyard.api.tinker_sample_wire import write_sample
from trainyard.parallel.config import RuleError
from trainyard.service.errors import ClientNotFound
from trainyard.service.tenancy.users import User

tinker = pytest.importorskip("tinker")


def test_a_sample_result_reads_back_through_the_sdks_own_converter():
    from tinker.proto.response_conv import deserialize_sample_response

    result = {"type": "sample", "sequences": [
        {"tokens": [5, 7, 0], "logprobs": [-0.5, -1.25, -2.0], "stop_reason": "stop",
         "topk_logprobs": [[(5, -0.5), (6, -1.0)], [(7, -1.25), (1, -3.0)], [(0, -2.0), (2, -2.5)]]},
        {"tokens": [5, 8], "logprobs": [-0.5, -4.0], "stop_reason": "length",
         "topk_logprobs": [[(5, -0.5), (6, -1.0)], [(7, -1.25), (1, -3.0)]]}],
        "prompt_logprobs": [None, -3.5, -0.75], "topk_prompt_logprobs": [None, [(4, -1.0)], [(9, -0.5)]]}
    out = deserialize_sample_response(write_sample(result))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in out.sequences] == [
        ([5, 7, 0], [-0.5, -1.25, -2.0], "stop"), ([5, 8], [-0.5, -4.0], "length")]
    assert out.sequences[0].topk_logprobs == [[(5, -0.5), (6, -1.0)], [(7, -1.25), (1, -3.0)], [(0, -2.0), (2, -2.5)]]
    assert out.prompt_logprobs == [None, -3.5, -0.75]
    assert out.topk_prompt_logprobs == [None, [(4, -1.0)], [(9, -0.5)]]
    plain = deserialize_sample_response(write_sample({"sequences": [result["sequences"][1] | {"topk_logprobs": []}]}))
    assert plain.prompt_logprobs is None and plain.topk_prompt_logprobs is None


def test_sampling_sessions_are_their_owners_and_bad_params_name_their_field(tmp_path):
    from trainyard.service.store import JobStore
    from trainyard.service.tinker.clients import Client, TinkerClients

    alice, bob = User("alice", admin=False), User("bob", admin=False)
    tenancy = SimpleNamespace(store=JobStore(tmp_path / "jobs.db"))
    clients = TinkerClients(tenancy=tenancy, heartbeat_timeout_s=60)  # type: ignore[arg-type]
    clients._start_reaper = lambda: None  # type: ignore[method-assign]  # reaped by hand here
    samplers = clients.samplers
    session, bobs = clients.create_session(alice), clients.create_session(bob)
    clients.clients["model-1"] = Client("alice", session, "base", 4, "llama", {}, None, None, None, seq_len=64,
                                        vocab_size=256)
    samplers.saved["model-1"] = {"step-3": False}
    path = "tinker://model-1/sampler_weights/step-3"
    sampler = samplers.create_session(alice, session, path, None)
    assert samplers.info(alice, sampler) == {"sampler_id": sampler, "base_model": "base", "model_path": path}
    assert (samplers.join(alice, sampler), samplers.join(alice, sampler)) == (1, 2)
    for call in (lambda: samplers.create_session(bob, bobs, path, None), lambda: samplers.info(bob, sampler),
                 lambda: samplers.create_session(alice, session, "tinker://model-1/sampler_weights/never", None),
                 lambda: samplers.create_session(alice, bobs, path, None),
                 lambda: samplers.sample(bob, sampler, None, {"prompt": [1], "sampling_params": {}}),
                 lambda: samplers.save_for_sampler(bob, "model-1", "mine")):
        with pytest.raises(ClientNotFound):
            call()
    for call, field in ((lambda: samplers.create_session(alice, session, "tinker://model-1/weights/x", None),
                         "model_path"),
                        (lambda: samplers.create_session(alice, session, None, None), "model_path"),
                        (lambda: samplers.save_for_sampler(alice, "model-1", "../up"), "path"),
                        (lambda: samplers.sample(alice, sampler, None, {"prompt": [1], "sampling_params": {
                            "top_p": 1.5}}), "sampling_params.top_p"),
                        (lambda: samplers.sample(alice, None, None, {"prompt": [1]}), "sampling_session_id")):
        with pytest.raises(RuleError) as e:
            call()
        assert e.value.field == field
    clients.reap(now=clients.sessions[session].beat + 61)  # both sessions stop beating
    with pytest.raises(ClientNotFound):
        samplers.info(alice, sampler)
