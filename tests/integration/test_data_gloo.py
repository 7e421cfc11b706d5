"""Prepared data trained by real gloo ranks (no Ray), several plans in one spawned world of two processes:

- chat data: the masked loss of step 0 equals transformers' `GPT2LMHeadModel` loss on the same global batch
  with the prompt labels at -100 (trainyard's gpt2 weights copied in by a small map); the losses of two steps
  and the val_loss are the same at dp=1, at dp=2 with two micro-batches per rank, and at tp=2 (the
  vocabulary-parallel loss ignores -100 too);
- a batch whose targets are all masked has loss 0 and gradient 0 (no division by zero);
- training on a directory prepared from Parquet makes val_loss fall;
- whole examples (`packing: false`) over two epochs at dp=1 and dp=2: each sequence once per epoch, the same
  losses, and step 0's loss equals transformers' on each example run alone (summed, over the counted targets);
  with LoRA the same at dp=1 and dp=2;
- a stop mid-epoch (the dp=2 run's checkpoint) resumed at dp=1 sees the same samples and losses as the straight run;
- packed examples (`packing: true`) the same way, at dp=2 with gpipe and full recompute (every forward runs
  before the first backward, whose recompute must read its own micro-batch's documents again): each row once
  per epoch, and step 0's loss is transformers' on each example of its rows run alone (the kin at dp2 x tp2:
  test_hf_families_gloo.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from data_helpers import bpe_tokenizer, examples_loss
from gloo_ranks import PlanRun, RankResult, run_plans
from helpers import REPO, tiny_spec
from trainyard.parallel.data.datasets import open_dataset
from trainyard.parallel.data.examples import epochs_steps
from trainyard.parallel.data.prepare import PrepareOptions, prepare
from trainyard.parallel.data.sampler import global_batch_ids
from trainyard.parallel.io import checkpoint
from trainyard.parallel.models.whole import full_model
from trainyard.parallel.plan import Plan, make_plan
from trainyard.parallel.spec import parse_spec

MID_EPOCH = 3
"""examples_dp2 saves after step 3 (of the first epoch's 6 or so), and a run resumed there at dp1 goes on."""


def _plan_run(plan: Plan) -> PlanRun:
    """The plan's steps, with val_loss after every `eval.every`-th."""
    every, steps = plan.config.eval.every, plan.config.steps
    return PlanRun(plan, evaluate_after=tuple(range(every, steps + 1, every)) if every else ())


def _rows(results: list[RankResult]) -> list[dict]:
    """Rank 0's loss, grad_norm and val_loss (None where eval was not due) of each step."""
    return [{"loss": s["loss"], "grad_norm": s["grad_norm"], "val_loss": s.get("val_loss")} for s in results[0].stats]


@pytest.mark.parametrize("kind", ["examples", "packed"])
def test_whole_examples_are_each_seen_once_per_epoch_at_dp1_and_dp2(runs, kind):
    plans, rows = runs
    one, two = f"{kind}_dp1", f"{kind}_dp2"
    sequences = open_dataset(plans[one].config).num_samples
    g = plans[one].config.global_batch
    for name in (one, two):
        seen = [i for row in rows[name] for i in row["sample_ids"]]
        assert sorted(seen[:sequences]) == list(range(sequences)) == sorted(seen[sequences:2 * sequences])
        assert rows[name][-1]["epoch"] >= 2.0 > rows[name][-2]["epoch"]
    assert [r["sample_ids"] for r in rows[two]] == [r["sample_ids"] for r in rows[one]]
    for a, b in zip(rows[one], rows[two], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert len(rows[one][0]["sample_ids"]) == g


def test_a_stop_and_resume_mid_epoch_at_another_layout_gives_the_straight_run(runs):
    plans, rows = runs
    assert 0 < rows["examples_dp1"][MID_EPOCH - 1]["epoch"] < 1  # the save fell inside the first epoch
    straight, resumed = rows["examples_dp1"][MID_EPOCH:], rows["examples_resumed"]
    assert [r["sample_ids"] for r in resumed] == [r["sample_ids"] for r in straight]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], rel=1e-5)


def test_whole_examples_with_lora_at_dp2_follow_dp1_each_seen_once_per_epoch(runs):
    plans, rows = runs
    sequences = open_dataset(plans["examples_lora_dp1"].config).num_samples
    for name in ("examples_lora_dp1", "examples_lora_dp2"):
        seen = [i for row in rows[name] for i in row["sample_ids"]]
        assert sorted(seen[:sequences]) == list(range(sequences)) == sorted(seen[sequences:2 * sequences])
        assert [r["sample_ids"] for r in rows[name]] == [r["sample_ids"] for r in rows["examples_dp1"]]
    for one, two in zip(rows["examples_lora_dp1"], rows["examples_lora_dp2"], strict=True):
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
    # B starts at zero: the first step is the plain model's; then only the adapters learn, not as the full model
    assert rows["examples_lora_dp1"][0]["loss"] == pytest.approx(rows["examples_dp1"][0]["loss"], abs=1e-6)
    assert rows["examples_lora_dp1"][-1]["loss"] != pytest.approx(rows["examples_dp1"][-1]["loss"], abs=1e-4)
    assert rows["examples_lora_dp1"][-1]["loss"] < rows["examples_lora_dp1"][0]["loss"]


def test_a_padded_example_s_loss_is_transformers_loss_on_the_example_alone(runs):
    plans, rows = runs
    cfg = plans["examples_dp1"].config
    ds = open_dataset(cfg)
    assert ds.cut_examples > 0  # some examples are longer than seq_len: their pieces are examples here too
    hf = hf_gpt2(cfg.model, cfg.seed, cfg.model.seq_len + 1)
    total, counted = 0.0, 0
    with torch.no_grad():
        for i in rows["examples_dp1"][0]["sample_ids"]:  # each alone, unpadded, prompt labels at -100
            a, b = int(ds.starts[i]), int(ds.stops[i])
            tokens = torch.as_tensor(ds.tokens[a:b].astype("int64"))[None]
            labels = tokens.clone()
            labels[0, 1:][~ds.target_mask(i)[: b - a - 1]] = -100
            n = int((labels[0, 1:] != -100).sum())
            if n:
                total += hf(input_ids=tokens, labels=labels).loss.item() * n
                counted += n
    assert rows["examples_dp1"][0]["loss"] == pytest.approx(total / counted, abs=1e-5)


def test_a_packed_batch_s_loss_is_transformers_loss_on_each_example_alone(runs):
    plans, rows = runs
    cfg = plans["packed_dp1"].config
    ds = open_dataset(cfg)
    assert ds.num_samples < len(ds.starts)  # rows hold several examples
    hf = hf_gpt2(cfg.model, cfg.seed, cfg.model.seq_len + 1)
    expected = examples_loss(hf, ds, rows["packed_dp1"][0]["sample_ids"])
    assert rows["packed_dp1"][0]["loss"] == pytest.approx(expected, abs=1e-5)
    assert rows["packed_dp2"][0]["loss"] == pytest.approx(expected, abs=1e-5)
    val = [(one["val_loss"], two["val_loss"]) for one, two in zip(rows["packed_dp1"], rows["packed_dp2"], strict=True)
           if one["val_loss"] is not None]
    assert val and all(b == pytest.approx(a, rel=1e-5) and math.isfinite(a) for a, b in val)


def spec(path: Path, **overrides) -> dict:
    return tiny_spec(**{"model": {"vocab_size": 300}, "data": {"kind": "tokens", "path": str(path)}, "steps": 2,
                        "optimizer": {"lr": 3e-3, "warmup_steps": 0}, **overrides})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gloo-data")
    tok = bpe_tokenizer(root / "tok")
    prepare([REPO / "examples" / "finetune.jsonl"], root / "chat", tok, PrepareOptions(chat=True), progress=False)
    records = [json.loads(line) for line in (REPO / "examples" / "finetune.jsonl").read_text().splitlines()]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "completion": ""}) + "\n"
                                                for r in records if "prompt" in r))
    prepare([root / "prompts.jsonl"], root / "prompts", tok, PrepareOptions(chat=True), progress=False)
    import pyarrow as pa
    import pyarrow.parquet as pq

    paragraphs = (REPO / "examples" / "corpus.txt").read_text().split("\n\n")
    pq.write_table(pa.table({"text": paragraphs}), root / "corpus.parquet")
    prepare([root / "corpus.parquet"], root / "corpus", tok, progress=False)
    chat = spec(root / "chat", eval={"every": 2, "batches": 2})
    whole = spec(root / "chat", data={"kind": "tokens", "path": str(root / "chat"), "packing": False, "epochs": 2},
                 model={"vocab_size": 300, "seq_len": 40})
    whole["steps"] = epochs_steps(2, open_dataset(parse_spec(whole)).num_samples, whole["global_batch"])
    lora = {**whole, "model": {**whole["model"], "lora": {"rank": 4, "alpha": 8, "targets": ["q", "v", "fc", "proj"]}}}
    packed = {**whole, "data": {**whole["data"], "packing": True}, "model": {**whole["model"], "seq_len": 128},
              "eval": {"every": 2, "batches": 1}}  # validation on held-out packed rows too
    packed["steps"] = epochs_steps(2, open_dataset(parse_spec(packed)).num_samples, packed["global_batch"])
    plans = {
        "examples_dp1": make_plan(parse_spec(whole)),
        "examples_dp2": make_plan(parse_spec({**whole, "parallel": {"dp": 2, "microbatches": 2}})),
        "examples_lora_dp1": make_plan(parse_spec(lora)),
        "examples_lora_dp2": make_plan(parse_spec({**lora, "parallel": {"dp": 2, "microbatches": 2}})),
        "packed_dp1": make_plan(parse_spec(packed)),
        "packed_dp2": make_plan(parse_spec({**packed, "parallel": {"dp": 2, "microbatches": 2, "schedule": "gpipe"},
                                            "activation_checkpointing": "full"})),
        "chat_dp2": make_plan(parse_spec({**chat, "parallel": {"dp": 2, "microbatches": 2}})),
        "chat_dp1": make_plan(parse_spec(chat)),
        "chat_tp2": make_plan(parse_spec({**chat, "parallel": {"tp": 2}})),  # vocabulary-parallel loss, -100
        "masked": make_plan(parse_spec({**spec(root / "prompts", steps=1), "parallel": {"dp": 2}})),
        "corpus": make_plan(parse_spec({**spec(root / "corpus", steps=30, eval={"every": 10, "batches": 2}),
                                        "parallel": {"dp": 2}})),
    }
    runs = [_plan_run(plan) for plan in plans.values()]
    # examples_dp2 saves mid-epoch; the same job resumed from it at dp1 (another layout) runs the rest
    mine = list(plans).index("examples_dp2")
    runs[mine] = dataclasses.replace(runs[mine], save_after=(MID_EPOCH,), root=str(root / "examples_dp2"))
    runs.append(PlanRun(plans["examples_dp1"], resume=(str(checkpoint.step_dir(root / "examples_dp2", MID_EPOCH)),
                                                       MID_EPOCH)))
    results = run_plans(runs)  # one world of two processes
    rows = {name: _rows(r) for name, r in zip(plans, results[:len(plans)], strict=True)}
    rows["examples_resumed"] = [{**row, "sample_ids": s["sample_ids"]}
                                for row, s in zip(_rows(results[-1]), results[-1][0].stats, strict=True)]
    # each step's global batch, in dp rank order (dp rank = rank here)
    for name in ("examples_dp1", "examples_dp2", "examples_lora_dp1", "examples_lora_dp2", "packed_dp1", "packed_dp2"):
        ranks = results[list(plans).index(name)]
        for step, row in enumerate(rows[name]):
            row["sample_ids"] = [i for r in ranks for i in r.stats[step]["sample_ids"]]
            row["epoch"] = ranks[0].stats[step]["epoch"]
    return plans, rows


def hf_gpt2(model_cfg, seed: int, positions: int):
    """transformers' GPT2LMHeadModel holding trainyard's gpt2 weights: q|k|v concatenated into c_attn, the
    Conv1D weights transposed (they are stored (in, out))."""
    from transformers import GPT2Config, GPT2LMHeadModel

    ours = full_model(model_cfg, seed).state_dict()
    config = GPT2Config(vocab_size=model_cfg.vocab_size, n_positions=positions, n_embd=model_cfg.d_model,
                        n_layer=model_cfg.n_layer, n_head=model_cfg.n_head, activation_function="gelu",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                        tie_word_embeddings=False)
    hf = GPT2LMHeadModel(config).eval()
    theirs = {"transformer.wte.weight": ours["wte.weight"], "transformer.ln_f.weight": ours["ln_f.weight"],
              "transformer.ln_f.bias": ours["ln_f.bias"], "lm_head.weight": ours["lm_head.weight"]}
    wpe = hf.state_dict()["transformer.wpe.weight"].clone()
    wpe[: model_cfg.context] = ours["wpe.weight"]
    theirs["transformer.wpe.weight"] = wpe
    for i in range(model_cfg.n_layer):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            theirs[f"{h}{ln}.weight"], theirs[f"{h}{ln}.bias"] = ours[f"{b}{ln}.weight"], ours[f"{b}{ln}.bias"]
        qkv = [f"{b}attn.{x}" for x in "qkv"]
        theirs[f"{h}attn.c_attn.weight"] = torch.cat([ours[f"{n}.weight"] for n in qkv]).T
        theirs[f"{h}attn.c_attn.bias"] = torch.cat([ours[f"{n}.bias"] for n in qkv])
        for ours_name, hf_name in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            theirs[f"{h}{hf_name}.weight"] = ours[f"{b}{ours_name}.weight"].T
            theirs[f"{h}{hf_name}.bias"] = ours[f"{b}{ours_name}.bias"]
    missing, unexpected = hf.load_state_dict(theirs, strict=False)
    assert not unexpected and all(k.endswith("attn.bias") or k.endswith("masked_bias") for k in missing), missing
    return hf


def test_masked_loss_equals_transformers_loss_with_prompt_labels_ignored(runs):
    plans, rows = runs
    cfg = plans["chat_dp1"].config
    ds = open_dataset(cfg)
    ids = global_batch_ids(cfg.seed, 0, cfg.global_batch, ds.num_samples)
    # HF shifts labels inside: give it the seq_len + 1 tokens of each sample as input and as labels, with the
    # uncounted targets at -100, and its logits at positions 0..seq_len-1 predict trainyard's pre-shifted targets.
    windows = torch.stack([ds.sample(i) for i in ids])
    labels = windows.clone()
    labels[:, 1:][~torch.stack([ds.target_mask(i) for i in ids])] = -100
    assert (labels[:, 1:] == -100).any() and (labels[:, 1:] != -100).any()
    with torch.no_grad():
        expected = hf_gpt2(cfg.model, cfg.seed, cfg.model.seq_len + 1)(input_ids=windows, labels=labels).loss.item()
    assert rows["chat_dp1"][0]["loss"] == pytest.approx(expected, abs=1e-5)
    assert rows["chat_dp2"][0]["loss"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("layout", ["chat_dp2", "chat_tp2"])
def test_masked_loss_and_val_loss_are_the_same_at_dp1_dp2_and_tp2(runs, layout):
    _, rows = runs
    for one, other in zip(rows["chat_dp1"], rows[layout], strict=True):
        assert other["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert other["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    assert rows["chat_dp1"][-1]["val_loss"] is not None
    assert rows[layout][-1]["val_loss"] == pytest.approx(rows["chat_dp1"][-1]["val_loss"], rel=1e-5)


def test_a_batch_with_every_target_masked_has_zero_loss_and_gradient(runs):
    _, rows = runs
    assert rows["masked"][0]["loss"] == 0.0 and rows["masked"][0]["grad_norm"] == 0.0


def test_training_on_a_prepared_directory_makes_val_loss_fall(runs):
    _, rows = runs
    val = [r["val_loss"] for r in rows["corpus"] if r["val_loss"] is not None]
    assert len(val) == 3 and val[-1] < val[0] - 0.3, val
