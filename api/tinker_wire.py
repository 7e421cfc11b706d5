"""The Tinker SDK's protobuf payloads, read and written: a `forward_backward` request (its datums' tokens,
`target_tokens` and `weights`) into plain lists, and a forward_backward result (per-datum `logprobs`, `metrics`)
into the SDK's `ForwardBackwardOutput` message. The message classes are the SDK's own (`tinker.proto`), imported
when a request first needs them, so the API starts without the SDK installed (such a request is then a 501).

Errors in a request are `WireError`s naming the field, never quoting the request's data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_INPUTS = 16
"""The most `loss_fn_inputs` a datum may name."""


class WireError(ValueError):
    """A payload that cannot be read: `field` names what is wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class SdkMissing(RuntimeError):
    """The service's Python has no `tinker` package to read the SDK's messages with."""


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: list[dict[str, list]]
    """Each datum's `tokens`, `target_tokens` and its other `loss_fn_inputs` by name, as long as each other."""
    loss_fn_config: dict[str, float] | None = None


def _pb() -> Any:
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:
        raise SdkMissing("this service reads the Tinker SDK's messages with its own `tinker` package (pip install "
                         "'trainyard[tinker]'), which is not installed") from e
    return tinker_public_pb2


def read_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A forward_backward request's protobuf body; WireError naming the field if it cannot be one."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, or worse on garbage
        raise WireError("body", "not a ForwardBackwardRequest message") from None
    if not msg.model_id:
        raise WireError("model_id", "missing")
    data: list[dict[str, list]] = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"data[{i}].model_input", "only encoded_text chunks are served yet")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = dict(datum.loss_fn_inputs)
        if "target_tokens" not in inputs:
            raise WireError(f"data[{i}].loss_fn_inputs.target_tokens", "missing")
        if len(inputs) > MAX_INPUTS or any(not name.isidentifier() or name == "tokens" for name in inputs):
            raise WireError(f"data[{i}].loss_fn_inputs", "names other than a loss's inputs")
        read: dict[str, list] = {"tokens": tokens}
        for name, tensor in sorted(inputs.items()):
            values = _tensor(pb, tensor, f"data[{i}].loss_fn_inputs.{name}")
            if len(values) != len(tokens):
                raise WireError(f"data[{i}].loss_fn_inputs.{name}", "not as long as model_input")
            read[name] = [int(v) for v in values] if name == "target_tokens" else [float(v) for v in values]
        data.append(read)
    if not data:
        raise WireError("data", "no datum")
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items()} or dict(msg.loss_fn_config)
    if any(v.WhichOneof("value") == "text" for v in msg.loss_fn_config_v2.values()):
        raise WireError("loss_fn_config", "text values are not served")
    return ForwardBackwardCall(msg.model_id, msg.seq_id, msg.loss_fn, msg.forward_only, data, config or None)


def _tensor(pb: Any, t: Any, field: str) -> list:
    if t.HasField("sparse_csr"):
        raise WireError(field, "sparse tensors are not served yet")
    dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}.get(t.dtype)
    if dtype is None:
        raise WireError(field, "dtype is not float32, int64 or int32")
    if len(t.dense) % np.dtype(dtype).itemsize:
        raise WireError(field, "its bytes are not whole elements")
    values = np.frombuffer(t.dense, dtype=dtype)
    if not np.all(np.isfinite(values)):
        raise WireError(field, "has values that are not finite")
    return values.tolist()


def write_forward_backward(result: dict[str, Any]) -> bytes:
    """A forward_backward result (`logprobs`: one list per datum; `metrics`) as the SDK's message."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics.update({k: float(v) for k, v in result["metrics"].items()})
    rows = [np.asarray(row, dtype=np.float32) for row in result["logprobs"]]
    offsets = np.cumsum([0, *(row.nbytes for row in rows)]).astype(np.int64)
    record = out.loss_fn_outputs.add(num_datums=len(rows))
    logprobs = record.fields["logprobs"]
    logprobs.data = b"".join(row.tobytes() for row in rows)
    logprobs.offsets = offsets.tobytes()
    logprobs.dtype = pb.DTYPE_FLOAT32
    return bytes(out.SerializeToString())
