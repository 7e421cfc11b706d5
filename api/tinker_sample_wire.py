"""A sample's result as the Tinker SDK reads it: its `SampleResponse` protobuf message (the SDK takes that type as
protobuf only), from the rank's plain answer (`parallel.runtime.sampling.generate`): each sequence's tokens (int32),
logprobs (float32) and stop reason, its top-k where asked, and the prompt's logprobs (NaN where not scored) and
top-k (the SDK's empty rows: token 0, logprob -99999) where asked. The message classes are the SDK's own, read
through `api.tinker_wire` (`SdkMissing` without it)."""

from __future__ import annotations

from typing import Any

import numpy as np
from trainyard.api.tinker_wire import _pb

EMPTY_LOGPROB = -99999.0
"""The SDK's logprob of an empty top-k cell (`tinker.types.topk_logprobs.MASK_LOGPROB`)."""


def _topk(pb: Any, rows: list[list[tuple[int, float]] | None]) -> Any:
    """Rows of up to k (token, logprob) pairs (None: a position not scored) as the SDK's dense TopkLogprobs."""
    k = max((len(r) for r in rows if r is not None), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), EMPTY_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or ()):
            ids[i, j], logprobs[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))


def write_sample(result: dict[str, Any]) -> bytes:
    """The rank's answer to a sample (`sequences`, and where asked `prompt_logprobs`, `topk_prompt_logprobs`) as
    the SDK's SampleResponse message."""
    pb = _pb()
    out = pb.SampleResponse()
    for s in result["sequences"]:
        seq = out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s["stop_reason"] == "stop" else
                                pb.STOP_REASON_LENGTH, tokens=np.asarray(s["tokens"], dtype=np.int32).tobytes(),
                                logprobs=np.asarray(s["logprobs"], dtype=np.float32).tobytes())
        if "topk_logprobs" in s:
            seq.topk_sampled_logprobs.CopyFrom(_topk(pb, s["topk_logprobs"]))
    if result.get("prompt_logprobs") is not None:
        values = [np.nan if v is None else v for v in result["prompt_logprobs"]]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if result.get("topk_prompt_logprobs") is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(pb, result["topk_prompt_logprobs"]))
    return bytes(out.SerializeToString())
