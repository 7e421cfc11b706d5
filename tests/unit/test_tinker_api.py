"""The Tinker-compatible API's pure parts: the SDK's protobuf forward_backward request read as the SDK's own
converter writes it, a result written as the SDK's own reader reads it, bad payloads refused naming the field and
never quoting data; `X-API-Key: tml-<token>` is the token's user; a session whose heartbeat stopped is closed and its
clients released, and every id is its owner's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from trainyard.api.guard import Authenticate
from trainyard.api.tinker_wire import WireError, read_forward_backward, write_forward_backward
from trainyard.service.errors import ClientNotFound
from trainyard.service.tenancy.users import User

tinker = pytest.importorskip("tinker")


def _request(datums, loss_fn="cross_entropy", forward_only=False, config=None) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=datums, loss_fn=loss_fn, loss_fn_config=config),
        model_id="model-1", seq_id=3)
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_a_forward_backward_request_and_result_round_trip_through_the_sdks_own_converters():
    from tinker.proto.response_conv import deserialize_forward_backward_output

    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                               loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 0.5]})
    call = read_forward_backward(_request([datum, datum], forward_only=True))
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("model-1", 3, "cross_entropy", True)
    assert call.data[1] == {"tokens": [5, 6, 7], "target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 0.5]}

    inputs = {"target_tokens": [6, 7], "logprobs": [-1.5, -2.0], "advantages": [1.0, -1.0]}
    ppo = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6]), loss_fn_inputs=inputs)
    call = read_forward_backward(_request([ppo], "ppo", config={"clip_low_threshold": 0.7}))
    assert call.data == [{"tokens": [5, 6], **inputs}]
    assert (call.loss_fn, call.loss_fn_config) == ("ppo", {"clip_low_threshold": pytest.approx(0.7)})

    out = deserialize_forward_backward_output(write_forward_backward(
        {"logprobs": [[-1.0, -2.0, -3.0], [-0.5]], "metrics": {"loss:sum": 4.5}}))
    assert out.metrics == {"loss:sum": 4.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0, -3.0], [-0.5]]


def test_bad_payloads_are_refused_naming_the_field_without_their_data():
    with pytest.raises(WireError) as e:
        read_forward_backward(b"\xff\xfe secret garbage")
    assert e.value.field == "body" and "secret" not in str(e.value)
    short = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                               loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]})
    with pytest.raises(WireError, match=r"data\[0\]"):
        read_forward_backward(_request([short]))
    nan = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5]),
                             loss_fn_inputs={"target_tokens": [6], "weights": np.array([np.nan], np.float32)})
    with pytest.raises(WireError, match="weights"):
        read_forward_backward(_request([nan]))
    with pytest.raises(WireError, match="^data: "):
        read_forward_backward(_request([]))


def test_the_sdks_key_is_the_tokens_user():
    users = {"tok": "alice"}
    guard = Authenticate(None, authenticate=users.get)

    def user(*headers: tuple[bytes, bytes]):
        return guard._user({"headers": list(headers)})

    assert user((b"x-api-key", b"tml-tok")) == "alice"
    assert user((b"x-api-key", b"tok")) is None  # the SDK's prefix, or nothing
    assert user((b"x-api-key", b"tml-")) is None
    assert user((b"x-api-key", b"tml-other")) is None
    assert user((b"authorization", b"Bearer tok")) == "alice"


def test_a_silent_session_is_closed_and_ids_are_their_owners(tmp_path):
    from trainyard.actors.job_status import JobStatus
    from trainyard.service.store import JobRecord, JobStore
    from trainyard.service.tinker.clients import Client, TinkerClients

    alice, bob = User("alice", admin=False), User("bob", admin=False)
    store = JobStore(tmp_path / "jobs.db")
    clients = TinkerClients(tenancy=SimpleNamespace(store=store), heartbeat_timeout_s=60)  # type: ignore[arg-type]
    clients._start_reaper = lambda: None  # type: ignore[method-assign]  # reaped by hand here
    session = clients.create_session(alice)
    clients.clients["model-1"] = Client("alice", session, "base", 4, "llama", {}, None, None, None)
    store.insert(JobRecord(job_id="model-1", name="tinker-llama", status=JobStatus.RUNNING, spec={}, steps=0,
                           owner="alice", kind="tinker"))
    with pytest.raises(ClientNotFound):
        clients.heartbeat(bob, session)
    with pytest.raises(ClientNotFound):
        clients.info(bob, "model-1")
    assert clients.info(alice, "model-1")["lora_rank"] == 4
    clients.heartbeat(alice, session)
    beat = clients.sessions[session].beat
    clients.reap(now=beat + 59)
    assert "model-1" in clients.clients
    clients.reap(now=beat + 61)
    assert clients.clients == {} and clients.sessions == {}
    with pytest.raises(ClientNotFound):
        clients.heartbeat(alice, session)
    ended = store.get("model-1")  # its job row ended, saying why
    assert ended.status is JobStatus.STOPPED and "heartbeat stopped" in ended.error and ended.kind == "tinker"


def test_an_operators_base_model_is_a_name_and_a_directory(tmp_path):
    import argparse

    from trainyard.cli.main import _parser
    from trainyard.cli.offline import base_model

    assert base_model(f"llama = {tmp_path}/m") == ("llama", str(tmp_path / "m"))
    for bad in ("llama", "=dir", "llama="):
        with pytest.raises(argparse.ArgumentTypeError):
            base_model(bad)
    args = _parser().parse_args(["serve", "--base-model", f"a={tmp_path}", "--base-model", f"b={tmp_path}/b"])
    assert dict(args.base_model) == {"a": str(tmp_path), "b": str(tmp_path / "b")}
