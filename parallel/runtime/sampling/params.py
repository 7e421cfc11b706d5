"""What a sample asks for, checked: Tinker's `SampleRequest` (the prompt's tokens, `num_samples`, the prompt logprobs
and top-k asked for) and its `SamplingParams` (max_tokens, temperature, top_k, top_p, stop, seed), as `SampleCall`.
A request it cannot be is a `SampleError` naming the field as the SDK spells it (`sampling_params.top_p`), never
quoting the request's data.

The meaning of each, as Tinker's SDK documents them: temperature 0 is greedy (the argmax); top_k -1 is no limit;
top_p 1 keeps every token; `stop` None keeps the model's implicit stop tokens (its EOS: `implicit_stop_tokens`),
`[]` stops on nothing (only max_tokens ends a sequence), token ids or strings stop on those instead; `seed` makes
a sample reproducible (the same request, the same sequences). max_tokens None: up to the model's context.

No torch here: the service checks a request with it before any rank runs (a 422), and the rank checks it again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_SAMPLES = 128
"""The most sequences one request may ask for (`num_samples`)."""
MAX_TOPK = 64
"""The widest top-k of logprobs one request may ask for, per position."""
MAX_STOPS = 64
"""The most stop tokens or strings one request may give."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A model directory holding one of these has a tokenizer (stop strings need one)."""
MAX_NAMED = 32
"""The most named sampler weights (`save_weights_for_sampler(name)`) one training client keeps."""
MAX_EPHEMERAL = 8
"""The unnamed ones (`save_weights_and_get_sampling_client`) a training client keeps; older ones are dropped."""


class SampleError(ValueError):
    """A sample request that cannot be served as asked: `field` names what is wrong (the SDK's spelling)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class SampleCall:
    """A checked sample request (see the module's docstring for each field's meaning)."""

    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: tuple[int, ...] | None = None
    """None: the model's implicit stop tokens (its EOS)."""
    stop_strings: tuple[str, ...] = ()
    prompt_logprobs: bool = False
    topk_prompt: int = 0
    """Top-k logprobs at each prompt position (0: none asked)."""
    topk_sample: int = 0
    """Top-k logprobs at each sampled position (0: none asked)."""
    last_n: int | None = None
    """Only the prompt's last `last_n` positions are scored (None: all but the first)."""


def sample_call(request: Mapping[str, Any], seq_len: int, vocab_size: int, has_tokenizer: bool) -> SampleCall:
    """`request`: the SDK's SampleRequest as plain data, its prompt as a flat list of token ids (`prompt`), for a
    model of context `seq_len` and `vocab_size` ids; `has_tokenizer`: whether stop strings can be read. SampleError
    naming the field when it cannot be served."""
    prompt = request.get("prompt")
    if not isinstance(prompt, list | tuple) or not prompt:
        raise SampleError("prompt", "needs at least one token")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        raise SampleError("prompt", f"token ids must be integers from 0 to {vocab_size - 1}")
    if len(prompt) >= seq_len:
        raise SampleError("prompt", f"{len(prompt)} tokens leave no room to sample in the model's context of "
                                    f"{seq_len}")
    params = request.get("sampling_params")
    if not isinstance(params, Mapping):
        raise SampleError("sampling_params", "missing")
    room = seq_len - len(prompt)
    max_tokens = params.get("max_tokens")
    max_tokens = room if max_tokens is None else _int(max_tokens, "sampling_params.max_tokens", 1, None)
    if max_tokens > room:
        raise SampleError("sampling_params.max_tokens", f"the prompt's {len(prompt)} tokens and max_tokens must fit "
                                                        f"the model's context of {seq_len} tokens (at most {room})")
    temperature = _float(params.get("temperature", 1.0), "sampling_params.temperature")
    if temperature < 0:
        raise SampleError("sampling_params.temperature", "must be 0 (greedy) or more")
    top_p = _float(params.get("top_p", 1.0), "sampling_params.top_p")
    if not 0 < top_p <= 1:
        raise SampleError("sampling_params.top_p", "must be more than 0 and at most 1")
    top_k = _int(params.get("top_k", -1), "sampling_params.top_k", -1, None)
    if top_k == 0:
        raise SampleError("sampling_params.top_k", "must be -1 (no limit) or 1 or more")
    seed = params.get("seed")
    seed = None if seed is None else _int(seed, "sampling_params.seed", 0, 2**63 - 1)
    stop_tokens, stop_strings = _stop(params.get("stop"), vocab_size, has_tokenizer)
    logprobs = request.get("prompt_logprobs") or False
    if not isinstance(logprobs, bool):
        raise SampleError("prompt_logprobs", "must be true or false")
    widest = min(MAX_TOPK, vocab_size)
    topk_prompt = _int(request.get("topk_prompt_logprobs", 0), "topk_prompt_logprobs", 0, widest)
    topk_sample = _int(request.get("topk_sample_logprobs", 0), "topk_sample_logprobs", 0, widest)
    last_n = request.get("prompt_logprobs_last_n")
    if last_n is not None:
        if not logprobs:
            raise SampleError("prompt_logprobs_last_n", "applies to prompt logprobs: set prompt_logprobs")
        if len(prompt) < 2:
            raise SampleError("prompt_logprobs_last_n", "a one-token prompt has no position to score")
        last_n = _int(last_n, "prompt_logprobs_last_n", 1, len(prompt) - 1)
    if request.get("target_prompt_logprobs") is not None:
        raise SampleError("target_prompt_logprobs", "not served yet")
    if request.get("prompt_alt_tokens_k", 0):
        raise SampleError("prompt_alt_tokens_k", "not served yet")
    return SampleCall(tuple(prompt), _int(request.get("num_samples", 1), "num_samples", 1, MAX_SAMPLES), max_tokens,
                      temperature, top_k, top_p, seed, stop_tokens, stop_strings, logprobs, topk_prompt,
                      topk_sample, last_n)


def _stop(stop: Any, vocab_size: int, has_tokenizer: bool) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """(stop token ids, or None for the model's own; stop strings)."""
    if stop is None:
        return None, ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or len(items) > MAX_STOPS:
        raise SampleError("sampling_params.stop", f"a string, or a list of at most {MAX_STOPS} strings or token ids")
    if all(isinstance(s, str) for s in items) and items:
        if not all(items):
            raise SampleError("sampling_params.stop", "an empty string never stops a sequence")
        if not has_tokenizer:
            raise SampleError("sampling_params.stop", "stop strings need the base model's tokenizer, and its "
                                                      "directory holds none: give token ids")
        return (), tuple(items)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in items):
        raise SampleError("sampling_params.stop", f"token ids must be integers from 0 to {vocab_size - 1} (or all "
                                                  "strings)")
    return tuple(items), ()


def _int(value: Any, field: str, low: int, high: int | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        raise SampleError(field, f"must be an integer from {low}" + (f" to {high}" if high is not None else " up"))
    return value


def _float(value: Any, field: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise SampleError(field, "must be a finite number")
    return float(value)


def implicit_stop_tokens(directory: str | Path | None) -> tuple[int, ...]:
    """The model's EOS ids, as transformers' `generate` stops on them: its generation_config.json's
    `eos_token_id`, else its config.json's (one id or a list; none: nothing stops a sequence but its length)."""
    if directory is None:
        return ()
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((Path(directory) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ()


def has_tokenizer(directory: str | Path | None) -> bool:
    """Whether the model directory holds a tokenizer (`TOKENIZER_FILES`)."""
    return directory is not None and any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)
