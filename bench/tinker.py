"""Section "tinker": the Tinker-compatible API against what it stands beside, through the real service and the
official SDK.

Run: `python -m bench.run --only tinker` (a few minutes on 2 cores). One `trainyard serve --base-model
bench-llama=DIR` subprocess; the model is a Hugging Face Llama saved here (4 blocks, d_model 256, vocabulary 4096:
a step of 8 x 128 tokens takes a few hundred ms on this CPU, so the fixed costs weigh as they would on a real job).

- `round trip`: a training client's `forward_backward` + `optim_step` (LoRA rank 8, 8 datums of 128 tokens, one
  rank), timed at the SDK (each step's wall time, from the call to the step's result), against the same work as a
  batch job (the same base model, LoRA, global batch and sequence length; its `step_time_s` from the job's
  metrics): the median of the steps after the first two on each side. Target: <= 1.10x.
- `sampling`: tokens/s of an SDK `sample` (4 samples of 64 new tokens, greedy, no stop) on the client's sampler,
  against transformers' `generate` with its cache on the same model in this process (the base with PEFT's LoRA of
  the same rank on the same projections, as the client's model is: its adapters run unmerged on both sides; a
  batch of 4 rows of the prompt, greedy, one torch thread as a rank has): the median of 3 after one warm-up each.
  Target: >= 1.0x.

The four-tenant memory row (issue 62: one base held once for four LoRA tenants) waits for the shared base.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from bench.context import BenchContext
from bench.results import Row, at_least, at_most, ratio
from bench.service_job import BenchError, TrainyardService

SEQ, BATCH, STEPS, WARMUP, RANK = 128, 8, 10, 2, 8
NEW_TOKENS, SAMPLES, SAMPLE_ROUNDS = 64, 4, 3


def _base_model(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _job_spec(directory: Path) -> dict:
    return {"name": "bench-tinker-batch", "seed": 0, "init_from": {"hf": str(directory)},
            "model": {"seq_len": SEQ, "lora": {"rank": RANK, "alpha": float(RANK),
                                               "targets": ["q", "k", "v", "o", "gate", "up", "down"]}},
            "data": {"kind": "synthetic"}, "optimizer": {"kind": "adamw", "warmup_steps": 0, "grad_clip": 0.0},
            "steps": STEPS, "global_batch": BATCH}


def _client_steps(url: str, key: str) -> tuple[list[float], object]:
    """Each step's wall time at the SDK, and the training client."""
    import tinker

    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model="bench-llama", rank=RANK).result()
    g = torch.Generator().manual_seed(1)
    data = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(t[:-1]),
                               loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * SEQ})
            for t in torch.randint(0, 4096, (BATCH, SEQ + 1), generator=g).tolist()]
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        fb = training.forward_backward(data, "cross_entropy")
        training.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result()
        fb.result()
        times.append(time.perf_counter() - start)
    return times, training


def _our_sampling(training) -> float:
    import tinker

    sampler = training.save_weights_and_get_sampling_client()
    prompt = tinker.types.ModelInput.from_ints(list(range(1, 17)))
    params = tinker.types.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[])
    rates = []
    for i in range(SAMPLE_ROUNDS + 1):
        start = time.perf_counter()
        out = sampler.sample(prompt, SAMPLES, params).result()
        elapsed = time.perf_counter() - start
        made = sum(len(s.tokens) for s in out.sequences)
        if made != SAMPLES * NEW_TOKENS:
            raise BenchError(f"a sample made {made} tokens, not {SAMPLES * NEW_TOKENS}")
        if i:
            rates.append(made / elapsed)
    return statistics.median(rates)


def _their_sampling(directory: Path) -> float:
    from transformers import LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(LlamaForCausalLM.from_pretrained(directory),  # the adapted model, as ours samples
                               LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets)).eval()
        ids = torch.arange(1, 17)[None].expand(SAMPLES, -1)  # greedy: four rows of one prompt
        rates = []
        for i in range(SAMPLE_ROUNDS + 1):
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                     num_beams=1, use_cache=True)
            elapsed = time.perf_counter() - start
            if i:
                rates.append((out.shape[1] - ids.shape[1]) * SAMPLES / elapsed)
        return statistics.median(rates)
    finally:
        torch.set_num_threads(threads)


def run_section(ctx: BenchContext) -> list[Row]:
    from trainyard.service.tenancy import users

    directory = _base_model(ctx.run_dir / "llama")
    state = ctx.run_dir / "state"
    with TrainyardService(state, serve_args=("--base-model", f"bench-llama={directory}")) as service:
        url = f"http://127.0.0.1:{service.port}"
        ctx.log("the batch job")
        rows = service.run_job(_job_spec(directory))
        batch = statistics.median(r["step_time_s"] for r in rows[WARMUP:])
        ctx.log("the training client")
        key = "tml-" + users.create(state, "bench-tinker")
        times, training = _client_steps(url, key)
        ours_step = statistics.median(times[WARMUP:])
        ctx.log("sampling")
        ours_rate = _our_sampling(training)
    theirs_rate = _their_sampling(directory)
    return [
        Row("tinker: forward_backward + optim_step round trip vs the batch job's step", round(ours_step, 4),
            round(batch, 4), ratio(ours_step, batch), "s",
            f"LoRA rank {RANK}, {BATCH} x {SEQ} tokens, one rank; the SDK's wall time per step vs the job's "
            f"step_time_s, medians of steps {WARMUP + 1}-{STEPS}", section="tinker", target=at_most(1.10, "ratio")),
        Row("tinker: sampling tokens/s vs transformers generate (KV cache)", round(ours_rate, 1),
            round(theirs_rate, 1), ratio(ours_rate, theirs_rate), "tok/s",
            f"{SAMPLES} greedy samples of {NEW_TOKENS} tokens from a 16-token prompt; ours through the SDK (HTTP, "
            "the service's rank), theirs in-process on one thread (transformers + PEFT LoRA of the same rank); "
            "medians of 3", section="tinker",
            target=at_least(1.0, "ratio")),
    ]
