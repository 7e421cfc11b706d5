"""Tenants on one open-loop rank (`parallel.runtime.tinker.tenants`) without Ray: four LoRA clients of one tiny Hugging
Face Llama on one built rank, their calls interleaved (forward_backward, optim_step, a forward, save_for_sampler), give
each tenant exactly its run alone on a rank of its own (losses and final adapters); a new tenant starts from its seed's
adapters (the same seed: the same adapters, another: others); the sampler snapshots and a saved state are the tenant's
own. In `make test-slow`: at dp2 (two gloo ranks), with and without ZeRO-1, the same interleaving gives each tenant
its dp2 run alone."""

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
from trainyard.service.tinker.specs import client_config

ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01}
SEEDS = {"a": 0, "b": 1, "c": 2, "d": 0}
"""The tenants and their seeds: d starts from a's adapters, and trains on other data."""
SCHEDULE = ["a.fb", "b.fb", "a.optim", "c.fb", "b.fb", "d.fb", "b.optim", "a.fb", "c.optim", "d.optim", "a.optim",
            "b.fwd", "d.fb", "d.optim"]
"""Each tenant's calls, interleaved: two accumulations pending at once, steps of others between a tenant's."""


def _rank(directory: Path, store: Path, seed: int = 0, rank: int = 0, port: int = 0, dp: int = 1,
          tenant: str = "default", zero: int = 0) -> OpenLoopRank:
    config = client_config(None, ADMIN_USER, "tiny", 4, {"tiny": str(directory)}, seed=seed,  # type: ignore[arg-type]
                           parallel={"dp": dp, "zero": zero} if dp > 1 else None)
    init = f"file://{store}" if dp == 1 else None
    return OpenLoopRank(RankDriver(make_plan(config), rank, "127.0.0.1", port, init_method=init), tenant)


def _data(seed: int) -> list[list[Datum]]:
    """A tenant's datums, a new one for each of its calls."""
    g = torch.Generator().manual_seed(seed)
    calls = []
    for _ in range(8):
        rows = [torch.randint(0, 256, (12,), generator=g).tolist()]
        calls.append([Datum(r[:-1], r[1:], {"weights": [1.0] * (len(r) - 1)}) for r in rows])
    return calls


def _adapters(rank: OpenLoopRank) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in rank.tenants.params]


def _run(rank: OpenLoopRank, schedule: list[str], shared: bool) -> dict[str, dict]:
    """The schedule's calls (`shared`: all tenants on `rank`, each call naming its own; else `rank` is one tenant's
    own and runs only its calls); per tenant its losses and its adapters after its last call."""
    out: dict[str, dict] = {}
    calls = {t: iter(_data(10 + i)) for i, t in enumerate(SEEDS)}
    for entry in schedule:
        tenant, op = entry.split(".")
        name = tenant if shared else None
        record = out.setdefault(tenant, {"losses": []})
        if op == "optim":
            record["losses"].append(rank.optim_step(**ADAM, tenant=name)["steps"])
        else:
            got = rank.forward_backward(next(calls[tenant]), "cross_entropy", forward_only=op == "fwd", tenant=name)
            record["losses"].append(got["metrics"]["loss:sum"])
        rank.tenants.activate(name)
        record["adapters"] = _adapters(rank)
    return out


def _shared(rank: OpenLoopRank) -> dict[str, dict]:
    for tenant, seed in list(SEEDS.items())[1:]:
        rank.add_tenant(tenant, seed)
    return _run(rank, SCHEDULE, shared=True)


def test_four_interleaved_tenants_each_follow_their_run_alone(tmp_path):
    tiny_llama(tmp_path / "llama")
    rank = _rank(tmp_path / "llama", tmp_path / "store", tenant="a")
    start = _adapters(rank)
    rank.add_tenant("d", SEEDS["d"])
    assert all(torch.equal(x, y) for x, y in zip(start, _adapters(rank), strict=True))  # a's seed: a's adapters
    rank.add_tenant("b", SEEDS["b"])
    assert any(not torch.equal(x, y) for x, y in zip(start, _adapters(rank), strict=True))  # another seed: others
    rank.drop_tenant("b")
    rank.drop_tenant("d")
    with pytest.raises(OpenLoopError, match="model_id"):
        rank.optim_step(**ADAM, tenant="b")
    together = _shared(rank)
    assert rank.tenants.names and sorted(rank.tenants.names) == sorted(SEEDS)
    rank.close()
    for tenant, seed in SEEDS.items():
        alone = _rank(tmp_path / "llama", tmp_path / f"store_{tenant}", seed=seed)
        initial = _adapters(alone)
        mine = _run(alone, [e for e in SCHEDULE if e.startswith(f"{tenant}.")], shared=False)[tenant]
        alone.close()
        assert together[tenant]["losses"] == mine["losses"], tenant  # bit for bit
        for x, y in zip(together[tenant]["adapters"], mine["adapters"], strict=True):
            assert torch.equal(x, y), tenant
        assert any(not torch.equal(x, y) for x, y in zip(initial, mine["adapters"], strict=True))  # it trained


def test_sampler_snapshots_and_saved_state_are_the_tenants_own(tmp_path):
    """A snapshot of one tenant is unknown to another; a state one tenant saved loads into a new tenant, which then
    goes on as the saver does (the same losses), the saver's own state untouched by the load."""
    tiny_llama(tmp_path / "llama")
    data = _data(3)
    rank = _rank(tmp_path / "llama", tmp_path / "store", tenant="a")
    rank.add_tenant("b", 1)
    greedy = {"prompt": list(range(5, 12)), "num_samples": 1,
              "sampling_params": {"max_tokens": 4, "temperature": 0.0, "stop": []}}
    for step in range(2):
        rank.forward_backward(data[step], "cross_entropy", tenant="a")
        rank.optim_step(**ADAM, tenant="a")
    rank.save_for_sampler("kept", tenant="a")
    assert rank.sample(greedy, "kept", tenant="a")["sequences"]
    with pytest.raises((OpenLoopError, KeyError)):
        rank.sample(greedy, "kept", tenant="b")
    rank.save_state(str(tmp_path / "state"), {}, tenant="a")
    rank.add_tenant("c", 5)
    saved = str(checkpoint.step_dir(tmp_path / "state", 2))
    assert rank.load_state(saved, 2, optimizer=True, tenant="c") == {"steps": 2}
    after = {}
    for tenant in ("a", "c"):
        after[tenant] = [rank.forward_backward(data[2], "cross_entropy", tenant=tenant)["metrics"]["loss:sum"]]
        rank.optim_step(**ADAM, tenant=tenant)
        after[tenant].append(rank.forward_backward(data[3], "cross_entropy", tenant=tenant,
                                                   forward_only=True)["metrics"]["loss:sum"])
    assert after["a"] == after["c"]
    rank.close()


def test_a_tenant_that_left_leaves_nothing_to_the_next(tmp_path):
    """The live tenant dropped: a parked tenant that never stepped, brought in next, takes its first step as a new
    client does (none of the dropped tenant's moments), as one added afresh does."""
    tiny_llama(tmp_path / "llama")
    data = _data(4)
    rank = _rank(tmp_path / "llama", tmp_path / "store", tenant="x")
    rank.add_tenant("y", 1)  # y live, x parked
    rank.forward_backward(data[0], "cross_entropy", tenant="x")
    rank.optim_step(**ADAM, tenant="x")  # x has moments, y none
    rank.drop_tenant("x")
    after = {}
    for tenant in ("y", "z"):
        if tenant == "z":
            rank.add_tenant("z", 1)
        rank.forward_backward(data[1], "cross_entropy", tenant=tenant)
        rank.optim_step(**ADAM, tenant=tenant)
        rank.forward_backward(data[2], "cross_entropy", tenant=tenant)
        rank.optim_step(**ADAM, tenant=tenant)
        after[tenant] = _adapters(rank)
    for a, b in zip(after["y"], after["z"], strict=True):
        assert torch.equal(a, b)
    rank.close()


def _dp_rank(rank: int, port: int, directory: str, out: str, tenant: str | None, zero: int) -> None:
    """A dp2 rank: the four tenants interleaved (`tenant` None), or one tenant's run alone on ranks of its own."""
    seed = SEEDS[tenant] if tenant is not None else SEEDS["a"]
    open_rank = _rank(Path(directory), Path(out), seed=seed, rank=rank, port=port, dp=2, tenant=tenant or "a",
                      zero=zero)
    if tenant is None:
        got = _shared(open_rank)
    else:
        got = _run(open_rank, [e for e in SCHEDULE if e.startswith(f"{tenant}.")], shared=False)
    torch.save(got, Path(out) / f"{tenant}_rank{rank}.pt")
    open_rank.close()


@slow
@pytest.mark.parametrize("zero", [0, 1])
def test_four_interleaved_tenants_at_dp2_each_follow_their_dp2_run_alone(tmp_path, zero):
    """dp2 (the gradients summed through shared memory) and dp2 with ZeRO-1 (each rank its slice of the moments,
    the optimizer stepping views of the parameters)."""
    tiny_llama(tmp_path / "llama")
    for tenant in (None, *SEEDS):
        spawn(_dp_rank, 2, str(tmp_path / "llama"), str(tmp_path), tenant, zero)
    for r in range(2):
        together = torch.load(tmp_path / f"None_rank{r}.pt")
        for tenant in SEEDS:
            alone = torch.load(tmp_path / f"{tenant}_rank{r}.pt")[tenant]
            assert together[tenant]["losses"] == alone["losses"], (r, tenant)
            for x, y in zip(together[tenant]["adapters"], alone["adapters"], strict=True):
                assert torch.equal(x, y), (r, tenant)
