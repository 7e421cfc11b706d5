"""Generation on a trainyard model (`parallel.runtime.sampling`), in this process with torch alone: tiny Hugging Face
models loaded into trainyard's own (`full_model` + `load_into`), as a rank builds them. Greedy decoding with the KV
cache is transformers' `generate` token for token, for llama (grouped-query attention), mistral (a sliding window
shorter than the sequence), qwen3 (q/k norms), gpt2 (learned positions) and the transformers backend (its own
cache); each sampled token's logprob, the prompt's logprobs and their top-k are transformers' forward's (1e-5).
Sampling: a seed reproduces, top-k and top-p keep to their sets, stop tokens and stop strings end a sequence with
its stop token kept. A LoRA'd stage decodes with its adapters in the cached path (the recomputed one agrees). A
snapshot swaps in and back. A bad request is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import tiny_backend, tiny_gpt2, tiny_llama, tiny_mistral, tiny_qwen3
from trainyard.api.spec import parse_submitted_spec
from trainyard.parallel.io import hf_checkpoint
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.runtime.sampling.generate import generate, stop_strings
from trainyard.parallel.runtime.sampling.kv_cache import HFCache, NativeCache, Recompute, cached_model
from trainyard.parallel.runtime.sampling.params import SampleCall, SampleError, implicit_stop_tokens, sample_call
from trainyard.parallel.runtime.sampling.snapshots import Snapshots

CPU = torch.device("cpu")
PROMPT = (3, 17, 200, 45, 9)
BUILDERS = {"llama": tiny_llama, "mistral": lambda d: tiny_mistral(d, window=5), "qwen3": tiny_qwen3,
            "gpt2": tiny_gpt2, "gpt_neox": lambda d: tiny_backend("gpt_neox", d)}


def ours_and_theirs(kind: str, directory: Path):
    theirs = BUILDERS[kind](directory).eval()
    theirs.generation_config.eos_token_id = None  # a fixed length: nothing stops either early
    cfg = parse_submitted_spec({"init_from": {"hf": str(directory)}, "model": {"seq_len": 32}, "steps": 1}).model
    ours = full_model(cfg, seed=3)
    hf_checkpoint.load_into([ours], cfg, directory)
    return ours.eval(), theirs


def forward_logprobs(theirs, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(theirs(torch.tensor([tokens])).logits[0].float(), -1)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_greedy_decoding_with_the_cache_is_transformers_generate(kind, tmp_path):
    ours, theirs = ours_and_theirs(kind, tmp_path)
    model = cached_model(ours)
    assert isinstance(model, HFCache if kind == "gpt_neox" else NativeCache)
    call = SampleCall(PROMPT, num_samples=2, max_tokens=16, temperature=0.0, prompt_logprobs=True, topk_prompt=3)
    out = generate(model, call, CPU)
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)[0, len(PROMPT):]
    for s in out["sequences"]:
        assert s["tokens"] == expected.tolist() and s["stop_reason"] == "length"
    full = list(PROMPT) + out["sequences"][0]["tokens"]
    lp = forward_logprobs(theirs, full)
    picked = lp[len(PROMPT) - 1:-1].gather(1, torch.tensor(full[len(PROMPT):])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out["sequences"][0]["logprobs"]), picked, rtol=0, atol=1e-5)
    prompt_lp = lp[:len(PROMPT) - 1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert out["prompt_logprobs"][0] is None
    torch.testing.assert_close(torch.tensor(out["prompt_logprobs"][1:]), prompt_lp, rtol=0, atol=1e-5)
    top = torch.topk(lp[:len(PROMPT) - 1], 3, -1)
    assert out["topk_prompt_logprobs"][0] is None
    for row, ids, values in zip(out["topk_prompt_logprobs"][1:], top.indices, top.values, strict=True):
        assert [i for i, _ in row] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in row]), values, rtol=0, atol=1e-5)


def test_sampling_keeps_to_top_k_and_top_p_and_a_seed_reproduces(tmp_path):
    ours, theirs = ours_and_theirs("llama", tmp_path)
    base = SampleCall(PROMPT, num_samples=4, max_tokens=12, temperature=1.0, seed=7, topk_sample=2)
    first = generate(cached_model(ours), base, CPU)
    assert first == generate(cached_model(ours), base, CPU)  # the same seed: the same sequences
    other = generate(cached_model(ours), SampleCall(PROMPT, 4, 12, seed=8), CPU)
    assert [s["tokens"] for s in other["sequences"]] != [s["tokens"] for s in first["sequences"]]
    assert len({tuple(s["tokens"]) for s in first["sequences"]}) > 1  # the samples are drawn apart
    for s in first["sequences"]:  # each sampled token's logprob and the top-2 are the forward's
        lp = forward_logprobs(theirs, list(PROMPT) + s["tokens"])[len(PROMPT) - 1:-1]
        torch.testing.assert_close(torch.tensor(s["logprobs"]), lp.gather(1, torch.tensor(s["tokens"])[:, None])[:, 0],
                                   rtol=0, atol=1e-5)
        assert [[i for i, _ in row] for row in s["topk_logprobs"]] == torch.topk(lp, 2, -1).indices.tolist()
    for limits in ({"top_k": 3}, {"top_p": 0.3, "temperature": 0.7}):
        out = generate(cached_model(ours), SampleCall(PROMPT, 4, 10, seed=1, **limits), CPU)
        for s in out["sequences"]:
            logits = torch.log_softmax(forward_logprobs(theirs, list(PROMPT) + s["tokens"])[len(PROMPT) - 1:-1]
                                       / limits.get("temperature", 1.0), -1)
            for row, token in zip(logits, s["tokens"], strict=True):
                if "top_k" in limits:
                    assert token in torch.topk(row, 3).indices.tolist()
                else:  # the smallest set of the likeliest whose probability reaches top_p
                    probs, order = torch.sort(row.exp(), descending=True)
                    nucleus = order[:int((probs.cumsum(0) < 0.3).sum()) + 1].tolist()
                    assert token in nucleus
    greedy = generate(cached_model(ours), SampleCall(PROMPT, 1, 10, temperature=0.0), CPU)
    top1 = generate(cached_model(ours), SampleCall(PROMPT, 1, 10, top_k=1), CPU)
    assert top1["sequences"][0]["tokens"] == greedy["sequences"][0]["tokens"]


def test_a_stop_token_or_string_ends_a_sequence_keeping_its_stop(tmp_path):
    ours, _ = ours_and_theirs("llama", tmp_path / "m")
    tokens = generate(cached_model(ours), SampleCall(PROMPT, 1, 16, temperature=0.0), CPU)["sequences"][0]["tokens"]
    at = max(tokens.index(t) for t in tokens)  # a token's first place: the latest one
    stopped = generate(cached_model(ours), SampleCall(PROMPT, 2, 16, temperature=0.0), CPU,
                       stop_tokens=[tokens[at]])["sequences"]
    assert [(s["tokens"], s["stop_reason"]) for s in stopped] == [(tokens[:at + 1], "stop")] * 2
    assert implicit_stop_tokens(tmp_path / "m") == (0,)  # tiny_llama's eos_token_id
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "examples" / "tokenizer")
    text = tokenizer.decode(tokens[:at + 1])
    stop = stop_strings(tokenizer, [text[-1]])
    first = next(i for i in range(len(tokens)) if stop(tokens[:i + 1]))
    out = generate(cached_model(ours), SampleCall(PROMPT, 1, 16, temperature=0.0), CPU, stop_text=stop)
    assert out["sequences"][0] == {**out["sequences"][0], "tokens": tokens[:first + 1], "stop_reason": "stop"}


def test_a_lora_stage_decodes_with_its_adapters_and_a_snapshot_swaps_in_and_back(tmp_path):
    from dataclasses import replace

    from trainyard.parallel.config import LoraConfig
    from trainyard.parallel.models.components.lora import apply_lora

    tiny_llama(tmp_path)
    cfg = parse_submitted_spec({"init_from": {"hf": str(tmp_path)}, "model": {"seq_len": 64}, "steps": 1}).model
    stage = full_model(replace(cfg, lora=LoraConfig(rank=4, alpha=8.0)), seed=3)
    hf_checkpoint.load_into([stage], cfg, tmp_path)
    stage = apply_lora(stage, seed=3).eval()
    call = SampleCall(PROMPT, 1, 12, temperature=0.0, prompt_logprobs=True)
    snapshots = Snapshots(stage)
    snapshots.save("base")  # B = 0: the base model's weights
    base = generate(cached_model(stage), call, CPU)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn_like(p))
    adapted = generate(cached_model(stage), call, CPU)
    assert adapted["prompt_logprobs"] != base["prompt_logprobs"]
    recomputed = generate(Recompute(stage), call, CPU)
    assert adapted["sequences"][0]["tokens"] == recomputed["sequences"][0]["tokens"]
    torch.testing.assert_close(torch.tensor(adapted["sequences"][0]["logprobs"]),
                               torch.tensor(recomputed["sequences"][0]["logprobs"]), rtol=0, atol=1e-5)
    live = [p.clone() for p in snapshots.params]
    with snapshots.swapped_in("base"):
        assert generate(cached_model(stage), call, CPU) == base
    assert all(torch.equal(a, b) for a, b in zip(live, snapshots.params, strict=True))  # the live ones are back
    with pytest.raises(KeyError):
        with snapshots.swapped_in("never saved"):
            pass


@pytest.mark.parametrize("change,field", [
    ({"prompt": []}, "prompt"), ({"prompt": [3, 999]}, "prompt"), ({"prompt": list(range(64))}, "prompt"),
    ({"num_samples": 0}, "num_samples"), ({"sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_tokens": 60}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_tokens": 4, "temperature": -1}}, "sampling_params.temperature"),
    ({"sampling_params": {"max_tokens": 4, "top_p": 0}}, "sampling_params.top_p"),
    ({"sampling_params": {"max_tokens": 4, "top_k": 0}}, "sampling_params.top_k"),
    ({"sampling_params": {"max_tokens": 4, "seed": -1}}, "sampling_params.seed"),
    ({"sampling_params": {"max_tokens": 4, "stop": [300]}}, "sampling_params.stop"),
    ({"sampling_params": {"max_tokens": 4, "stop": "\n"}}, "sampling_params.stop"),
    ({"topk_prompt_logprobs": 65}, "topk_prompt_logprobs"), ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),
    ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
])
def test_a_request_that_cannot_be_served_names_its_field(change, field):
    request = {"prompt": list(PROMPT), "num_samples": 1, "sampling_params": {"max_tokens": 4}} | change
    with pytest.raises(SampleError) as e:
        sample_call(request, seq_len=64, vocab_size=256, has_tokenizer=False)
    assert e.value.field == field


def test_a_request_reads_as_the_sdk_means_it():
    call = sample_call({"prompt": list(PROMPT), "sampling_params": {"stop": [], "temperature": 0}}, 64, 256, False)
    assert (call.max_tokens, call.stop_tokens, call.num_samples, call.temperature) == (59, (), 1, 0.0)
    call = sample_call({"prompt": list(PROMPT), "prompt_logprobs": True, "prompt_logprobs_last_n": 2,
                        "sampling_params": {"max_tokens": 3, "stop": "ab", "seed": 4}}, 64, 256, True)
    assert (call.stop_strings, call.stop_tokens, call.seed, call.last_n) == (("ab",), (), 4, 2)
    assert sample_call({"prompt": [1], "sampling_params": {}}, 64, 256, False).stop_tokens is None
