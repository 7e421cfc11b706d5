"""Generation: a `SampleCall` (`params`) run on a `CachedModel` (`kv_cache`), answered as plain data.

The prompt is prefilled once (its cache then copied for each of `num_samples`), then every sequence still running
takes one token per step. Choosing a token, as transformers' logits warpers do, in their order: temperature 0 is
the argmax (greedy); otherwise the logits are divided by the temperature, top_k keeps the k largest, top_p keeps
the smallest set of the largest whose probabilities reach top_p (at least one), and the token is drawn from the
softmax of what is left with a generator seeded by `seed` (no seed: a fresh one), so a seeded request gives the
same sequences again. A sequence ends ("stop") on a stop token, which it keeps as its last, or when its text
(`stop_text`, the tokenizer's decoding) holds a stop string; else ("length") after max_tokens.

Logprobs are of the model's own distribution (the log-softmax of its logits, before temperature and the filters,
as vLLM reports them by default), in fp32: each sampled token's, each prompt token's given the tokens before it
(None at the first, and before the last `last_n` where asked), and the top-k of each position where asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from trainyard.parallel.runtime.sampling.kv_cache import CachedModel
from trainyard.parallel.runtime.sampling.params import SampleCall

StopText = Callable[[Sequence[int]], bool]
"""Whether a sequence's generated tokens hold a stop string (the tokenizer's text of them)."""


def choose(logits: torch.Tensor, call: SampleCall, generator: torch.Generator | None) -> torch.Tensor:
    """(b, vocab) fp32 logits -> (b,) the token each row takes."""
    if call.temperature == 0:
        return logits.argmax(-1)
    x = logits / call.temperature
    if 0 < call.top_k < x.shape[-1]:
        kth = torch.topk(x, call.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if call.top_p < 1:
        ascending, order = torch.sort(x, dim=-1)
        beyond = ascending.softmax(-1).cumsum(-1) <= 1 - call.top_p
        beyond[:, -1] = False  # the most likely token always stays
        x = x.scatter(-1, order, ascending.masked_fill(beyond, float("-inf")))
    return torch.multinomial(x.softmax(-1), 1, generator=generator)[:, 0]


def _topk(logprobs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    values, ids = torch.topk(logprobs, k, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def _prompt_scores(call: SampleCall, logits: torch.Tensor, first: int) -> dict[str, Any]:
    """The prompt's logprobs and top-k: `logits` (n, vocab) of positions first.. (the last one predicts the first
    sampled token, not a prompt token)."""
    t = len(call.prompt)
    out: dict[str, Any] = {}
    logprobs = torch.log_softmax(logits[:-1], dim=-1)  # row r: position first + r predicting prompt[first + r + 1]
    scored = [None] * (first + 1)
    if call.prompt_logprobs:
        targets = torch.tensor(call.prompt[first + 1:], device=logits.device)
        out["prompt_logprobs"] = scored + logprobs.gather(1, targets[:, None])[:, 0].tolist()
        assert len(out["prompt_logprobs"]) == t
    if call.topk_prompt:
        out["topk_prompt_logprobs"] = scored + _topk(logprobs, call.topk_prompt)
    return out


def generate(model: CachedModel, call: SampleCall, device: torch.device, stop_tokens: Sequence[int] = (),
             stop_text: StopText | None = None) -> dict[str, Any]:
    """Run `call` on `model`: `sequences` (each its `tokens`, `logprobs`, `stop_reason` and, where asked,
    `topk_logprobs`), and where asked `prompt_logprobs` and `topk_prompt_logprobs` (None at unscored positions).
    `stop_tokens`: the ids that end a sequence (`call.stop_tokens`, or the model's own where that is None)."""
    t = len(call.prompt)
    scores_prompt = call.prompt_logprobs or call.topk_prompt > 0
    first = (t - 1 - call.last_n if call.last_n is not None else 0) if scores_prompt and t > 1 else t - 1
    logits = model.prefill(torch.tensor([call.prompt], dtype=torch.long, device=device), first)[0]
    out: dict[str, Any] = _prompt_scores(call, logits, first) if scores_prompt else {}
    n = call.num_samples
    model.expand(n)
    last = logits[-1:].expand(n, -1)
    generator = None
    if call.temperature > 0:
        generator = torch.Generator(device=device)
        if call.seed is None:
            generator.seed()
        else:
            generator.manual_seed(call.seed)
    stops = set(stop_tokens)
    sequences: list[dict[str, Any]] = [{"tokens": [], "logprobs": [], "stop_reason": "length"} for _ in range(n)]
    if call.topk_sample:
        for s in sequences:
            s["topk_logprobs"] = []
    running = list(range(n))  # the sequence of each row of the batch
    for step in range(call.max_tokens):
        logprobs = torch.log_softmax(last, dim=-1)
        chosen = choose(last, call, generator)
        picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        tops = _topk(logprobs, call.topk_sample) if call.topk_sample else None
        keep = []
        for row, (seq, token) in enumerate(zip(running, chosen.tolist(), strict=True)):
            s = sequences[seq]
            s["tokens"].append(token)
            s["logprobs"].append(picked[row])
            if tops is not None:
                s["topk_logprobs"].append(tops[row])
            if token in stops or (stop_text is not None and stop_text(s["tokens"])):
                s["stop_reason"] = "stop"
            else:
                keep.append(row)
        if not keep or step == call.max_tokens - 1:
            break
        if len(keep) < len(running):
            rows = torch.tensor(keep, device=device)
            model.select(rows)
            chosen = chosen[rows]
            running = [running[r] for r in keep]
        last = model.step(chosen[:, None])
    out["sequences"] = sequences
    return out


def stop_strings(tokenizer: Any, strings: Sequence[str]) -> StopText:
    """A `StopText` for `strings` with a transformers tokenizer: the generated tokens' text holds one of them."""
    def holds(tokens: Sequence[int]) -> bool:
        text = tokenizer.decode(list(tokens))
        return any(s in text for s in strings)

    return holds
