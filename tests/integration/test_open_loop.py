"""The open loop's rank (`parallel.runtime.open_loop`) without Ray: a Tinker client's JobConfig
(`service.tinker.specs`) built from a tiny Hugging Face Llama, one rank. forward_backward accumulates gradients until
optim_step: two calls on halves then a step leave the same weights as one call on both; a forward leaves none; the
per-token logprobs are transformers' own; bad input is refused naming the field, the rank still usable."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import tiny_llama
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.open_loop import Datum, OpenLoopError, OpenLoopRank
from trainyard.service.tenancy.users import ADMIN_USER
from trainyard.service.tinker.specs import client_config


def _rank(directory, store) -> OpenLoopRank:
    config = client_config(None, ADMIN_USER, "tiny", 4, {"tiny": str(directory)})  # type: ignore[arg-type]
    return OpenLoopRank(RankDriver(make_plan(config), 0, "127.0.0.1", 0, init_method=f"file://{store}"))


def _datum(tokens: list[int]) -> Datum:
    return Datum(tokens[:-1], tokens[1:], [1.0] * (len(tokens) - 1))


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
        rank.forward_backward([Datum([1, 2], [2], [1.0])], "cross_entropy")
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


def test_a_client_layout_the_open_loop_cannot_run_is_refused_naming_parallel(tmp_path):
    from trainyard.parallel.config import RuleError

    tiny_llama(tmp_path / "llama")
    registered = {"tiny": str(tmp_path / "llama")}
    config = client_config(None, ADMIN_USER, "tiny", 4, registered, parallel={"dp": 2, "zero": 1})  # type: ignore[arg-type]
    assert (make_plan(config).dp, make_plan(config).parallel.zero, config.global_batch) == (2, 1, 2)
    for parallel, field in (({"dp": 2, "pp": 2}, "parallel"), ({"dp": 2, "zero": 3}, "parallel"),
                            ({"dp": "two"}, "parallel.dp")):
        with pytest.raises(RuleError) as e:
            client_config(None, ADMIN_USER, "tiny", 4, registered, parallel=parallel)  # type: ignore[arg-type]
        assert e.value.field == field
    with pytest.raises(RuleError) as e:
        client_config(None, ADMIN_USER, "tiny", None, registered)  # type: ignore[arg-type]
    assert e.value.field == "lora_config"
