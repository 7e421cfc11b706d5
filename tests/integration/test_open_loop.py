"""The open loop's rank (`parallel.runtime.open_loop`) and its losses (`parallel.runtime.tinker.losses`) without Ray: a
Tinker client's JobConfig (`service.tinker.specs`) built from a tiny Hugging Face Llama, one rank. forward_backward
accumulates gradients until optim_step: two calls on halves then a step leave the same weights as one call on both; a
forward leaves none; the per-token logprobs are transformers' own; bad input is refused naming the field, the rank
still usable. In `make test-slow`: a client at tp2 follows one rank (losses, logprobs, greedy and seeded samples);
the state a rank saves loads into another with its optimizer (the same losses) or without (a fresh AdamW)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_ranks import spawn
from helpers import slow
from hf_tiny import tiny_llama
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.open_loop import Datum, OpenLoopError, OpenLoopRank
from trainyard.service.tenancy.users import ADMIN_USER
from trainyard.service.tinker.specs import FORWARD_TOKENS, client_config


def _rank(directory, store) -> OpenLoopRank:
    config = client_config(None, ADMIN_USER, "tiny", 4, {"tiny": str(directory)})  # type: ignore[arg-type]
    return OpenLoopRank(RankDriver(make_plan(config), 0, "127.0.0.1", 0, init_method=f"file://{store}"))


def _datum(tokens: list[int], **inputs: list[float]) -> Datum:
    return Datum(tokens[:-1], tokens[1:], inputs or {"weights": [1.0] * (len(tokens) - 1)})


def _weights(rank: OpenLoopRank) -> list[torch.Tensor]:
    return [p.detach().clone() for p in rank.chunk.parameters() if p.requires_grad]


def test_gradients_accumulate_until_the_step(tmp_path):
    reference = tiny_llama(tmp_path / "llama").eval()
    torch.manual_seed(0)
    a, b = (torch.randint(0, 256, (13,)).tolist() for _ in range(2))
    adam = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01}

    rank = _rank(tmp_path / "llama", tmp_path / "store1")
    out = rank.forward_backward([_datum(a)], "cross_entropy", forward_only=True)  # a forward: no gradient kept
    with torch.no_grad():
        ids = torch.tensor([a])
        theirs = torch.log_softmax(reference(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])
    torch.testing.assert_close(torch.tensor(out["logprobs"][0]), theirs[:, 0], rtol=0, atol=1e-5)
    assert out["metrics"]["loss:sum"] == pytest.approx(-float(theirs.sum()), abs=1e-4)
    with pytest.raises(OpenLoopError, match="loss_fn"):
        rank.forward_backward([_datum(a)], "ppo")
    with pytest.raises(OpenLoopError, match=r"data\[0\]"):
        rank.forward_backward([Datum([1, 2], [2], {"weights": [1.0]})], "cross_entropy")
    with pytest.raises(OpenLoopError, match=r"data\[0\].loss_fn_inputs.logprobs"):
        rank.forward_backward([_datum(a)], "importance_sampling")
    with pytest.raises(OpenLoopError, match="loss_fn_config"):
        rank.forward_backward([_datum(a)], "cross_entropy", config={"clip_low_threshold": 0.5})
    rank.forward_backward([_datum(a)], "cross_entropy")
    rank.forward_backward([_datum(b)], "cross_entropy")
    rank.optim_step(**adam)
    halves = _weights(rank)
    rank.close()

    rank = _rank(tmp_path / "llama", tmp_path / "store2")
    start = _weights(rank)
    rank.forward_backward([_datum(a), _datum(b)], "cross_entropy")
    rank.optim_step(**adam)
    both = _weights(rank)
    rank.close()
    assert any(not torch.equal(s, w) for s, w in zip(start, both, strict=True))  # the step moved the adapters
    for h, w in zip(halves, both, strict=True):
        torch.testing.assert_close(h, w, rtol=0, atol=1e-6)


TP_ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
TP_GREEDY = {"prompt": list(range(5, 12)), "num_samples": 1,
             "sampling_params": {"max_tokens": 5, "temperature": 0.0, "stop": []}}
TP_SAMPLED = {**TP_GREEDY, "num_samples": 2, "sampling_params": {"max_tokens": 5, "temperature": 1.0, "stop": [],
                                                                 "seed": 7}}


def _tp_calls(rank: OpenLoopRank, data: list[Datum]) -> dict:
    """Two steps, then the loss after them, a greedy and a seeded sample: what tp2 must share with one rank."""
    losses = []
    for _ in range(2):
        losses.append(rank.forward_backward(data, "cross_entropy")["metrics"]["loss:sum"])
        rank.optim_step(**TP_ADAM)
    after = rank.forward_backward(data, "cross_entropy", forward_only=True)
    return {"losses": [*losses, after["metrics"]["loss:sum"]], "logprobs": after["logprobs"],
            "greedy": rank.sample(TP_GREEDY), "sampled": rank.sample(TP_SAMPLED)}


def _tp_rank(rank: int, port: int, directory: str, out: str, data: list[Datum]) -> None:
    config = client_config(None, ADMIN_USER, "tiny", 4, {"tiny": directory}, parallel={"tp": 2})  # type: ignore[arg-type]
    open_rank = OpenLoopRank(RankDriver(make_plan(config), rank, "127.0.0.1", port))
    torch.save(_tp_calls(open_rank, data), Path(out) / f"rank{rank}.pt")
    open_rank.close()


@slow
def test_a_tensor_parallel_client_follows_one_rank(tmp_path):
    """At tp2 (each rank its heads and half the vocabulary, the logprobs taken under `loss_parallel`) a client's
    losses and logprobs over two steps are one rank's (1e-5), and both ranks sample the one rank's tokens, greedy
    and seeded (each token drawn from the gathered logits)."""
    tiny_llama(tmp_path / "llama")
    torch.manual_seed(4)
    data = [_datum(torch.randint(0, 256, (11,)).tolist()) for _ in range(2)]
    one = _rank(tmp_path / "llama", tmp_path / "store")
    expected = _tp_calls(one, data)
    one.close()
    spawn(_tp_rank, 2, str(tmp_path / "llama"), str(tmp_path), data)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["losses"] == pytest.approx(expected["losses"], abs=1e-5)
        assert expected["losses"][2] < expected["losses"][0]
        torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(expected["logprobs"]), rtol=0,
                                   atol=1e-5)
        for kind in ("greedy", "sampled"):
            assert [s["tokens"] for s in got[kind]["sequences"]] == \
                [s["tokens"] for s in expected[kind]["sequences"]], (r, kind)


def test_a_client_layout_the_open_loop_cannot_run_is_refused_naming_parallel(tmp_path):
    from trainyard.parallel.config import RuleError

    tiny_llama(tmp_path / "llama")
    registered = {"tiny": str(tmp_path / "llama")}
    config = client_config(None, ADMIN_USER, "tiny", 4, registered, parallel={"dp": 2, "zero": 1})  # type: ignore[arg-type]
    plan = make_plan(config)
    assert (plan.dp, plan.parallel.zero, plan.micro_batch_size * config.model.seq_len) == (2, 1, FORWARD_TOKENS)
    for parallel, field in (({"dp": 2, "pp": 2}, "parallel.pp"), ({"dp": 2, "zero": 3}, "parallel.zero"),
                            ({"tp": 2, "sp": True}, "parallel.sp"), ({"dp": "two"}, "parallel.dp")):
        with pytest.raises(RuleError) as e:
            client_config(None, ADMIN_USER, "tiny", 4, registered, parallel=parallel)  # type: ignore[arg-type]
        assert e.value.field == field
    with pytest.raises(RuleError) as e:
        client_config(None, ADMIN_USER, "tiny", 0, registered)  # type: ignore[arg-type]
    assert e.value.field == "lora_config.rank"


def test_a_full_fine_tuning_client_trains_every_weight(tmp_path):
    """No LoRA rank: full fine-tuning. Every weight of the base model is trainable, its logprobs are transformers'
    own before the step, and a step moves every matrix."""
    reference = tiny_llama(tmp_path / "llama").eval()
    config = client_config(None, ADMIN_USER, "tiny", None, {"tiny": str(tmp_path / "llama")})  # type: ignore[arg-type]
    assert config.model.lora is None
    rank = OpenLoopRank(RankDriver(make_plan(config), 0, "127.0.0.1", 0, init_method=f"file://{tmp_path / 's'}"))
    params = dict(rank.chunk.named_parameters())
    assert params and all(p.requires_grad for p in params.values())
    start = {n: p.detach().clone() for n, p in params.items()}
    torch.manual_seed(5)
    a = torch.randint(0, 256, (9,)).tolist()
    out = rank.forward_backward([_datum(a)], "cross_entropy")
    with torch.no_grad():
        ids = torch.tensor([a])
        theirs = torch.log_softmax(reference(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])
    torch.testing.assert_close(torch.tensor(out["logprobs"][0]), theirs[:, 0], rtol=0, atol=1e-5)
    rank.optim_step(learning_rate=1e-2, eps=1e-8)
    moved = [n for n, p in params.items() if p.dim() == 2 and not torch.equal(p.detach(), start[n])]
    assert sorted(moved) == sorted(n for n, p in params.items() if p.dim() == 2)
    rank.close()


def test_importance_sampling_and_ppo_follow_their_documented_formulas(tmp_path):
    """Their values are the formulas' on transformers' logprobs; at a ratio of 1 (the sampling logprobs the
    current ones) their gradient is cross_entropy's with the advantages as weights: the same step."""
    reference = tiny_llama(tmp_path / "llama").eval()
    torch.manual_seed(2)
    a = torch.randint(0, 256, (13,)).tolist()
    advantages = torch.randn(12).tolist()
    with torch.no_grad():
        ids = torch.tensor([a])
        lp = torch.log_softmax(reference(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    sampled = (lp + 0.5 * torch.randn(12)).tolist()  # ratios well inside and outside PPO's clip
    adv = torch.tensor(advantages)
    ratio = torch.exp(lp - torch.tensor(sampled))
    expected = {"importance_sampling": -(ratio * adv).sum(),
                "ppo": -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum()}
    adam = {"learning_rate": 1e-2, "eps": 1e-8}

    rank = _rank(tmp_path / "llama", tmp_path / "store1")
    for loss_fn, value in expected.items():
        out = rank.forward_backward([_datum(a, logprobs=sampled, advantages=advantages)], loss_fn, forward_only=True)
        assert out["metrics"]["loss:sum"] == pytest.approx(float(value), abs=1e-5), loss_fn
    out = rank.forward_backward([_datum(a, logprobs=sampled, advantages=advantages)], "ppo", forward_only=True,
                                config={"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})
    assert out["metrics"]["loss:sum"] == pytest.approx(
        float(-torch.minimum(ratio * adv, ratio.clamp(0.5, 2.0) * adv).sum()), abs=1e-5)
    rank.forward_backward([_datum(a, logprobs=lp.tolist(), advantages=advantages)], "importance_sampling")
    rank.optim_step(**adam)
    sampled_step = _weights(rank)
    rank.close()

    rank = _rank(tmp_path / "llama", tmp_path / "store2")
    rank.forward_backward([_datum(a, weights=advantages)], "cross_entropy")
    rank.optim_step(**adam)
    for x, y in zip(sampled_step, _weights(rank), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    rank.close()


@slow
def test_state_saved_loads_with_its_optimizer_or_weights_only_with_a_fresh_one(tmp_path):
    """`save_state` then `load_state`: with the optimizer, a new rank goes on with the very losses of the one that
    saved; weights only, it holds the same adapters and its next step is a fresh AdamW's first (torch's own, on the
    same parameters and gradients), not a continuation."""
    tiny_llama(tmp_path / "llama")
    torch.manual_seed(3)
    data = [_datum(torch.randint(0, 256, (13,)).tolist()) for _ in range(2)]
    adam = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}

    def step(rank: OpenLoopRank) -> float:
        loss = rank.forward_backward(data, "cross_entropy")["metrics"]["loss:sum"]
        rank.optim_step(**adam)
        return loss

    rank = _rank(tmp_path / "llama", tmp_path / "store1")
    for _ in range(2):
        step(rank)
    root = tmp_path / "state"
    assert rank.save_state(str(root), {"note": "a test"}) == {"steps": 2}
    saved = _weights(rank)
    uninterrupted = [step(rank) for _ in range(2)]
    rank.close()
    found = checkpoint.latest_valid(root)
    assert found is not None and found.step == 2 and checkpoint.read_manifest(found.directory)["note"] == "a test"

    rank = _rank(tmp_path / "llama", tmp_path / "store2")
    assert rank.load_state(str(found.directory), 2, optimizer=True) == {"steps": 2}
    assert [step(rank) for _ in range(2)] == pytest.approx(uninterrupted, abs=1e-6)
    rank.close()

    rank = _rank(tmp_path / "llama", tmp_path / "store3")
    step(rank)  # a client that trained already: its own moments are dropped by a weights-only load
    assert rank.load_state(str(found.directory), 2, optimizer=False) == {"steps": 0}
    for mine, theirs in zip(_weights(rank), saved, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    rank.forward_backward(data, "cross_entropy")
    params = [p for p in rank.chunk.parameters() if p.requires_grad]
    reference = [p.detach().clone().requires_grad_(True) for p in params]
    for r, p in zip(reference, params, strict=True):
        r.grad = p.grad.detach().clone()
    fresh = torch.optim.AdamW(reference, lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]),
                              eps=adam["eps"], weight_decay=0.0)
    fresh.step()
    rank.optim_step(**adam)
    for mine, theirs in zip(_weights(rank), reference, strict=True):
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-7)
    assert step(rank) != pytest.approx(uninterrupted[1], abs=1e-4)  # not the continuation: the optimizer was fresh
    rank.close()
