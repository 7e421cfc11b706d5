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
- `tenants` (`--case tenants`; the two rows above are `--case service`): four LoRA tenants (rank 8, seeds 0-3) on one
  open-loop rank of the same base model (`parallel.runtime.tinker.tenants`, in this process, no service), each taking
  three steps of forward_backward + optim_step in a round robin: the rank's tensor bytes (every live tensor storage in
  the process, counted once, over the rank's build: the base, the live tenant's adapters, gradient buckets and moments,
  the parked tenants' adapters and moments), the most between calls, against one tenant's alone (the same count on a
  rank of its own) plus three adapters' state (their values and AdamW's state, from the parameters' sizes). Target:
  within 10%. Beside it, the same against four clients of their own (four times one tenant's). Tenant 0's losses must
  equal its run alone, bit for bit (a BenchError otherwise).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

from bench.context import BenchContext
from bench.results import Row, at_least, at_most, ratio, ratio_within
from bench.service_job import BenchError, TrainyardService

SEQ, BATCH, STEPS, WARMUP, RANK = 128, 8, 10, 2, 8
NEW_TOKENS, SAMPLES, SAMPLE_ROUNDS = 64, 4, 3
TENANTS, TENANT_STEPS = 4, 3
CASES = ("service", "tenants")


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
    cases = ctx.cases or CASES
    if set(cases) - set(CASES):
        raise BenchError(f"tinker: cases are {CASES}, not {sorted(set(cases) - set(CASES))}")
    directory = _base_model(ctx.run_dir / "llama")
    rows = _service_rows(ctx, directory) if "service" in cases else []
    return rows + (_tenant_rows(ctx, directory) if "tenants" in cases else [])


def _service_rows(ctx: BenchContext, directory: Path) -> list[Row]:
    from trainyard.service.tenancy import users

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


def _tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process, each storage once (views share theirs)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":  # type(): no deprecated proxy warns
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _tenant_run(directory: Path, store: Path, tenants: int) -> tuple[int, int, dict[int, list[float]]]:
    """`tenants` LoRA tenants (seeds 0, 1, ...) on one rank, TENANT_STEPS round robin steps each: the most tensor bytes
    the rank held between calls (over what the process held before it), one adapter's state bytes (values and
    optimizer state), and each tenant's losses."""
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.runtime.driver import RankDriver
    from trainyard.parallel.runtime.open_loop import Datum, OpenLoopRank
    from trainyard.parallel.runtime.tp.local_parts import local_part
    from trainyard.service.tenancy.users import ADMIN_USER
    from trainyard.service.tinker.specs import client_config

    before = _tensor_bytes()
    config = client_config(None, ADMIN_USER, "bench", RANK, {"bench": str(directory)})  # type: ignore[arg-type]
    rank = OpenLoopRank(RankDriver(make_plan(config), 0, "127.0.0.1", 0, init_method=f"file://{store}"), "0")
    for t in range(1, tenants):
        rank.add_tenant(str(t), t)
    g = torch.Generator().manual_seed(2)
    data = [Datum(t[:-1], t[1:], {"weights": [1.0] * SEQ}) for t in torch.randint(0, 4096, (2, SEQ + 1),
                                                                                    generator=g).tolist()]
    losses: dict[int, list[float]] = {t: [] for t in range(tenants)}
    most = 0
    for _ in range(TENANT_STEPS):
        for t in range(tenants):
            losses[t].append(rank.forward_backward(data, "cross_entropy", tenant=str(t))["metrics"]["loss:sum"])
            most = max(most, _tensor_bytes() - before)
            rank.optim_step(learning_rate=1e-3, tenant=str(t))
            most = max(most, _tensor_bytes() - before)
    adapters = sum(local_part(p).numel() * local_part(p).element_size() for _, p in rank.tenants.params)
    state = adapters + rank.trainer.optimizer.state_bytes()[0]
    rank.close()
    del rank
    return most, state, losses


def _tenant_rows(ctx: BenchContext, directory: Path) -> list[Row]:
    ctx.log("one tenant on a rank")
    one, state, alone = _tenant_run(directory, ctx.run_dir / "store1", 1)
    ctx.log(f"{TENANTS} tenants on a rank")
    four, _, together = _tenant_run(directory, ctx.run_dir / "store4", TENANTS)
    if together[0] != alone[0]:
        raise BenchError(f"tenant 0's losses {together[0]} are not its run alone's {alone[0]}")
    expected = one + (TENANTS - 1) * state
    mib = 2**20
    note = (f"LoRA rank {RANK} on every projection, seeds 0-{TENANTS - 1}, {TENANT_STEPS} round robin steps each "
            f"of 2 x {SEQ} tokens; every live tensor storage once, the most between calls; one tenant alone "
            f"{one / mib:.2f} MiB, an adapter's state (values + AdamW's) {state / mib:.2f} MiB; tenant 0's losses "
            "equal its run alone's")
    return [
        Row(f"tinker: {TENANTS} LoRA tenants on one base, a rank's tensor MiB vs one tenant's + "
            f"{TENANTS - 1} adapters' state", round(four / mib, 2), round(expected / mib, 2), ratio(four, expected),
            "MiB", note, section="tinker", target=ratio_within(0.10)),
        Row(f"tinker: {TENANTS} LoRA tenants on one base, a rank's tensor MiB vs {TENANTS} clients of their own",
            round(four / mib, 2), round(TENANTS * one / mib, 2), ratio(four, TENANTS * one), "MiB",
            f"four ranks of one tenant each hold the base four times; {note}", section="tinker"),
    ]
