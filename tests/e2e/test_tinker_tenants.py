"""Tenants through the official Tinker SDK (`service.tinker.sharing`): two users' LoRA clients of one base model at one
layout share one client's ranks (the second attaches as a tenant: the same actor, no ranks of its own), each with its
own model id that the other user's calls answer as missing; their calls interleaved, each client's losses and its
sampler weights' logprobs are its run alone's (a rank of its own, in this process, at its seed); the first client's
unload leaves the second training on the ranks, and the second's releases them. In `make test-slow`: a rank that dies
under two tenants is rebuilt with both, each back at its own state."""

from __future__ import annotations

import httpx
import pytest
import ray
import torch
from helpers import slow
from hf_tiny import tiny_llama
from trainyard.actors.job_status import JobStatus
from trainyard.service.tenancy import users

tinker = pytest.importorskip("tinker")

STEPS = 3
ADAM = {"learning_rate": 2e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}


def _alone(directory: str, seed: int, rows: list[list[int]], store) -> tuple[list[float], list[float]]:
    """A client's losses over STEPS steps on a rank of its own (no Ray), and the logprobs of its first row after the
    first step."""
    from trainyard.parallel.plan import make_plan
    from trainyard.parallel.runtime.driver import RankDriver
    from trainyard.parallel.runtime.open_loop import Datum, OpenLoopRank
    from trainyard.service.tenancy.users import ADMIN_USER
    from trainyard.service.tinker.specs import client_config

    config = client_config(None, ADMIN_USER, "tiny", 4, {"tiny": directory}, seed=seed)  # type: ignore[arg-type]
    rank = OpenLoopRank(RankDriver(make_plan(config), 0, "127.0.0.1", 0, init_method=f"file://{store}"))
    data = [Datum(r[:-1], r[1:], {"weights": [1.0] * (len(r) - 1)}) for r in rows]
    losses, logprobs = [], []
    for step in range(STEPS):
        losses.append(rank.forward_backward(data, "cross_entropy")["metrics"]["loss:sum"])
        rank.optim_step(**ADAM)
        if step == 0:
            logprobs = rank.forward_backward(data[:1], "cross_entropy", forward_only=True)["logprobs"][0]
    rank.close()
    return losses, logprobs


def test_two_users_clients_of_one_base_share_its_ranks_each_as_alone(service, tmp_path):
    tiny_llama(tmp_path / "llama")
    service.manager.tinker.registered["tinker-tenants-llama"] = str(tmp_path / "llama")
    keys = {name: "tml-" + users.create(service.state_dir, f"tinker-tenant-{name}") for name in ("erin", "finn")}
    torch.manual_seed(6)
    rows = {name: [torch.randint(0, 256, (11,)).tolist() for _ in range(2)] for name in keys}
    clients = {name: tinker.ServiceClient(base_url=service.url, api_key=key) for name, key in keys.items()}
    erin = clients["erin"].create_lora_training_client(base_model="tinker-tenants-llama", rank=4, seed=0).result()
    finn = clients["finn"].create_lora_training_client(base_model="tinker-tenants-llama", rank=4, seed=1).result()
    live = service.manager.tinker.clients
    assert live[finn.model_id].actor is live[erin.model_id].actor and erin.model_id != finn.model_id

    with httpx.Client(base_url=service.url, timeout=30) as http:  # finn's key does not reach erin's model
        assert http.post("/api/v1/unload_model", headers={"X-API-Key": keys["finn"]},
                         json={"model_id": erin.model_id}).status_code == 404

    def datums(name: str):
        return [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(r[:-1]),
                                   loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
                for r in rows[name]]

    adam = tinker.types.AdamParams(**ADAM)
    losses: dict[str, list[float]] = {"erin": [], "finn": []}
    for step in range(STEPS):
        order = (("erin", erin), ("finn", finn)) if step < STEPS - 1 else (("finn", finn),)
        pending = [(name, training.forward_backward(datums(name), "cross_entropy")) for name, training in order]
        for name, fb in pending:  # both accumulations pending at once on the shared ranks
            losses[name].append(fb.result().metrics["loss:sum"])
        for _, training in order:
            training.optim_step(adam).result()
        if step == 0:  # each tenant's sampler weights: its own adapters, on the shared ranks
            scored = {name: training.save_weights_and_get_sampling_client().result().compute_logprobs(
                tinker.types.ModelInput.from_ints(rows[name][0])).result()[1:] for name, training in order}
        if step == STEPS - 2:  # erin leaves; finn goes on on the ranks
            with httpx.Client(base_url=service.url, timeout=30) as http:
                assert http.post("/api/v1/unload_model", headers={"X-API-Key": keys["erin"]},
                                 json={"model_id": erin.model_id}).status_code == 200
    assert finn.model_id in live and erin.model_id not in live
    for name, seed in (("erin", 0), ("finn", 1)):
        alone, logprobs = _alone(str(tmp_path / "llama"), seed, rows[name], tmp_path / f"s{seed}")
        assert losses[name] == pytest.approx(alone[:len(losses[name])], abs=1e-6), name
        torch.testing.assert_close(torch.tensor(scored[name]), torch.tensor(logprobs), rtol=0, atol=1e-5)
    assert len(losses["erin"]) == STEPS - 1 and len(losses["finn"]) == STEPS
    with httpx.Client(base_url=service.url, timeout=30) as http:
        assert http.post("/api/v1/unload_model", headers={"X-API-Key": keys["finn"]},
                         json={"model_id": finn.model_id}).status_code == 200
    assert finn.model_id not in live
    assert service.manager.store.get(finn.model_id).status == JobStatus.STOPPED


@slow
def test_a_rank_that_dies_under_two_tenants_brings_each_back_to_its_own_state(service, tmp_path):
    """The shared rank killed: the call that meets it fails saying the ranks were rebuilt; each tenant then goes on
    from its own state, the one that saved at its saved loss, the one that never saved at fresh adapters'."""
    tiny_llama(tmp_path / "llama")
    service.manager.tinker.registered["tinker-tenants-kill"] = str(tmp_path / "llama")
    keys = {name: "tml-" + users.create(service.state_dir, f"tinker-kill-{name}") for name in ("gail", "hugo")}
    torch.manual_seed(7)
    row = torch.randint(0, 256, (11,)).tolist()
    data = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(row[:-1]),
                               loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)})]
    made = {name: tinker.ServiceClient(base_url=service.url, api_key=key).create_lora_training_client(
        base_model="tinker-tenants-kill", rank=4, seed=i).result() for i, (name, key) in enumerate(keys.items())}
    gail, hugo = made["gail"], made["hugo"]
    assert service.manager.tinker.clients[hugo.model_id].actor is service.manager.tinker.clients[gail.model_id].actor
    fresh = hugo.forward(data, "cross_entropy").result().metrics["loss:sum"]
    adam = tinker.types.AdamParams(**ADAM)
    for training in (gail, hugo):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(adam).result()
    at_save = gail.forward(data, "cross_entropy").result().metrics["loss:sum"]
    gail.save_state("before-the-kill").result()
    gail.forward_backward(data, "cross_entropy").result()
    gail.optim_step(adam).result()
    ray.kill(ray.get_actor(f"trainyard/tinker-{gail.model_id}/pp0-tp0-dp0"), no_restart=True)
    with pytest.raises(Exception, match="rebuilt from the base model with fresh adapters"):
        hugo.forward_backward(data, "cross_entropy").result(timeout=60)
    assert gail.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] == pytest.approx(at_save,
                                                                                                       abs=1e-5)
    assert hugo.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] == pytest.approx(fresh, abs=1e-5)
    with httpx.Client(base_url=service.url, timeout=30) as http:
        for name, training in made.items():
            assert http.post("/api/v1/unload_model", headers={"X-API-Key": keys[name]},
                             json={"model_id": training.model_id}).status_code == 200
