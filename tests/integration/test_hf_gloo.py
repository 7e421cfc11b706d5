"""Hugging Face checkpoints at a 3D layout (dp2 x pp2 x tp2 = 8 gloo ranks, one spawned world for both
families): a tiny LlamaForCausalLM (GQA) and a tiny GPT2LMHeadModel as published, both with tied embeddings
(`tie_word_embeddings`: the last stage holds its own copy of the embedding, `parallel.runtime.pipeline.tied`), loaded
with `init_from` give transformers' first-step loss and follow the same job at pp=1 (one rank, one tied tensor); the two
copies are bitwise equal after every step; each rank reads only its own blocks of the checkpoint; the state
trained at that layout, exported as an HF directory, loads in transformers with no missing or unexpected keys and
gives trainyard's logits and the layout's next loss. In the same world, LoRA on the
Llama (every projection adapted) at (dp2, zero 3) and at the 3D layout follows its one-rank twin; the frozen base
stays bitwise the checkpoint's, the optimizer state is the adapters' alone (as the memory plan says), and the 3D
run's export loads in peft onto the base with trainyard's logits, its merged export in transformers. So do LoRA on
a 4-block Llama at pp=2 under zbv, whose split backward's weight half skips the frozen base, with full recompute
(`make test-slow`: under every other schedule, gpipe and interleaved-1f1b at vpp=2 and zb-h1, and in bf16 at (dp2,
pp2) against a bf16 twin), and
the 3D run's checkpoint resumed at (dp2, zero 1) for its second step. And the
transformers backend (`model.family: hf`) on three architectures no native family reads (GPT-NeoX, whose head is
`embed_out` in its checkpoints; Gemma 2; OLMo 2):
transformers' first loss, dp2 with ZeRO-3 and per-layer recompute following one rank, a resume at dp1 from the dp2
checkpoint continuing the curve (Gemma 2), and an export transformers loads with trainyard's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_ranks import PlanRun, run_plans
from helpers import SLOW_TESTS, tiny_spec
from hf_tiny import BACKEND_ARCHITECTURES, hf_loss, tiny_backend, tiny_gpt2, tiny_llama
from trainyard.api.spec import parse_submitted_spec
from trainyard.parallel.io import checkpoint
from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.driver import RankDriver

LAYOUT = {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}
ATOL = 1e-5
LORA = {"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
LORA_LAYOUTS = {"lora-one": {}, "lora-z3": {"dp": 2, "zero": 3}, "lora-3d": LAYOUT}
LORA_SCHEDULES = {  # on a 4-block llama (vpp=2 at pp=2 needs 4 stages), each against its one-rank twin
    "one": {},
    "gpipe": {"pp": 2, "vpp": 2, "schedule": "gpipe", "microbatches": 2},
    "interleaved": {"pp": 2, "vpp": 2, "schedule": "interleaved-1f1b", "microbatches": 2},
    "zb-h1-recompute": {"pp": 2, "schedule": "zb-h1", "microbatches": 2},
    "zbv-recompute": {"pp": 2, "vpp": 2, "schedule": "zbv", "microbatches": 2},
    "one-bf16": {},
    "bf16": {"dp": 2, "pp": 2, "microbatches": 2},
}
"""The split backward's weight half (zb-h1, zbv) skips the frozen base; recompute runs under it, as does bf16.
`make test` runs zbv's (the V, the split backward and recompute at once) and its twin; `make test-slow` every one."""
LORA_SCHEDULES_RUN = tuple(LORA_SCHEDULES) if SLOW_TESTS else ("one", "zbv-recompute")
LORA_RESUME = {"dp": 2, "zero": 1}
"""lora-3d's checkpoint after step 1, resumed at another layout for step 2."""
CURVE_ATOL = 1e-4
_TIED_AFTER_STEPS: list[dict[str, torch.Tensor]] = []
"""A rank's copies of the tied embedding (its local parts) after each step it ran."""


class _CountingOpen:
    """safe_open whose slices count the elements they return: what a rank really read from the files."""

    read: list[tuple[str, int]] = []

    def __init__(self, *args, **kwargs):
        from safetensors import safe_open

        self._f = safe_open(*args, **kwargs)

    def get_slice(self, key):
        sliced, read = self._f.get_slice(key), self.read

        class Counted:
            def __getitem__(self, index):
                t = sliced[index]
                read.append((key, t.numel()))
                return t

            def get_shape(self):
                return sliced.get_shape()

        return Counted()

    def keys(self):
        return self._f.keys()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _count_reads() -> None:
    """Before a rank's driver (and so its trainer, which reads init_from.hf) is built: count what it reads, and
    keep its copies of the tied embedding after each step."""
    from trainyard.parallel.io import hf_checkpoint
    from trainyard.parallel.runtime.tp.local_parts import local_part
    from trainyard.parallel.runtime.trainer import RankTrainer

    hf_checkpoint.safe_open = _CountingOpen
    _CountingOpen.read.clear()
    _TIED_AFTER_STEPS.clear()
    if getattr(RankTrainer.queue_step, "keeps_tied_copies", False):  # an earlier run in this process wrapped it
        return
    step = RankTrainer.queue_step

    def queue_step(self, *args, **kwargs):
        queued = step(self, *args, **kwargs)
        copies = {"embedding": self.tied.embedding, "head": self.tied.head}
        _TIED_AFTER_STEPS.append({k: local_part(p).detach().clone() for k, p in copies.items() if p is not None})
        return queued

    queue_step.keeps_tied_copies = True  # type: ignore[attr-defined]
    RankTrainer.queue_step = queue_step  # type: ignore[method-assign]


def _read_and_held(driver: RankDriver, stats: list[dict]) -> dict:
    """What the rank read of the checkpoint, what it holds, and its two steps' losses."""
    from trainyard.parallel.runtime.tp.local_parts import local_part

    read = sum(n for _, n in _CountingOpen.read)
    held = sum(local_part(p).numel() for chunk in driver.trainer.chunks for p in chunk.parameters())
    c = driver.trainer.coords
    return {"read": read, "held": held, "losses": (stats[0]["loss"], stats[1]["loss"]), "coords": (c.dp, c.tp),
            "tied": list(_TIED_AFTER_STEPS)}


def _frozen_and_state(driver: RankDriver, stats: list[dict]) -> dict:
    """Whether every frozen parameter still equals its block of the HF checkpoint, and the optimizer's bytes."""
    from trainyard.parallel.io import hf_checkpoint
    from trainyard.parallel.io.hf_spec import adapter_for_family
    from trainyard.parallel.models.components.hf_mapping import from_hf_block, hf_block
    from trainyard.parallel.runtime.tp.local_parts import local_part

    cfg = driver.trainer.plan.config
    files = hf_checkpoint.HFFiles(Path(cfg.init_from.hf))
    sources = adapter_for_family(cfg.model.family).sources(cfg.model, files.file_of.keys())
    frozen = [(sources[n], p) for chunk in driver.trainer.chunks for n, p in chunk.named_parameters()
              if not p.requires_grad]
    same = all(torch.equal(from_hf_block(s, files.read(s.key, hf_block(s, hf_checkpoint.local_block(p)))),
                           local_part(p)) for s, p in frozen)
    return {"frozen": len(frozen), "unchanged": same, "optimizer_bytes": [s["optimizer_bytes"] for s in stats]}


ZERO = {"llama": 3, "gpt2": 0}
"""llama at ZeRO-3: `init_from` is read straight into FSDP2's shards of tp's shards (uneven ones included)."""


def _spec(directory: Path, parallel: dict = LAYOUT, lora: dict | None = None, **top) -> dict:
    spec = tiny_spec(init_from={"hf": str(directory)}, global_batch=8, steps=2, parallel=parallel,
                     optimizer={"lr": 1e-2, "warmup_steps": 0}, **top)
    spec["model"] = {"seq_len": 16} | ({"lora": lora} if lora else {})  # the architecture comes from config.json
    return spec


def _schedule_spec(directory: Path, name: str) -> dict:
    top = {"precision": "bf16"} if "bf16" in name else {}
    top |= {"activation_checkpointing": "full"} if "recompute" in name else {}
    return _spec(directory, LORA_SCHEDULES[name], LORA, **top)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Both families trained two steps at the 3D layout: (HF models, configs, per-rank results, out dir), and at
    pp=1 on one rank (per_rank[0][f"{name}-pp1"])."""
    root = tmp_path_factory.mktemp("hf3d")
    models = {"llama": tiny_llama(root / "llama-src", tied=True), "gpt2": tiny_gpt2(root / "gpt2-src")}
    configs = {name: parse_submitted_spec(_spec(root / f"{name}-src", {**LAYOUT, "zero": ZERO[name]}))
               for name in models}
    plans = {name: make_plan(cfg) for name, cfg in configs.items()}
    plans |= {f"{name}-pp1": make_plan(parse_submitted_spec(_spec(root / f"{name}-src", {"microbatches": 4})))
              for name in models}
    lora = {name: make_plan(parse_submitted_spec(_spec(root / "llama-src", par, LORA)))
            for name, par in LORA_LAYOUTS.items()}
    tiny_llama(root / "llama4-src", layers=4)
    lora |= {f"lora4-{name}": make_plan(parse_submitted_spec(_schedule_spec(root / "llama4-src", name)))
             for name in LORA_SCHEDULES_RUN}
    resumed = make_plan(parse_submitted_spec(_spec(root / "llama-src", LORA_RESUME, LORA)))
    backend = _backend_runs(root)
    # two steps, the state after the first saved under root/<name>: one spawned world of 8 for every plan
    results = run_plans([PlanRun(plan, save_after=(1,) if plan.world_size > 1 else (), root=str(root / name),
                                 setup=_count_reads, probe=_read_and_held) for name, plan in plans.items()]
                        + [PlanRun(plan, save_after=(1,) if name in LORA_LAYOUTS else (), root=str(root / name),
                                   probe=_frozen_and_state) for name, plan in lora.items()]
                        + [PlanRun(resumed, resume=(str(checkpoint.step_dir(root / "lora-3d", 1)), 1),
                                   probe=_frozen_and_state)]
                        + list(backend[2].values()))
    per_rank = [{name: results[i][r].probe for i, name in enumerate(plans) if r < len(results[i])} for r in range(8)]
    lora_runs = {name: (plan, results[len(plans) + i]) for i, (name, plan) in enumerate(lora.items())}
    lora_runs["lora-resumed"] = (resumed, results[len(plans) + len(lora)])
    curves = {key: [[s["loss"] for s in r.stats] for r in ranks]
              for key, ranks in zip(backend[2], results[len(plans) + len(lora) + 1:], strict=True)}
    return models, configs, per_rank, root, lora_runs, (backend[0], backend[1], curves)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_init_from_gives_transformers_first_step_loss_at_3d(world, name):
    models, configs, per_rank, _, _ = world[:5]
    losses = {r[name]["losses"][0] for r in per_rank if r[name]["losses"][0] is not None}
    assert len(losses) == 1
    assert abs(losses.pop() - hf_loss(models[name], configs[name], 0)) < ATOL


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tied_embeddings_at_3d_follow_pp1_and_stay_bitwise_equal(world, name):
    _, _, per_rank, _, _ = world[:5]
    at_3d = next(r[name]["losses"] for r in per_rank if r[name]["losses"][0] is not None)
    at_pp1 = per_rank[0][f"{name}-pp1"]["losses"]
    assert max(abs(a - b) for a, b in zip(at_3d, at_pp1, strict=True)) < CURVE_ATOL
    embeddings = {r[name]["coords"]: r[name]["tied"] for r in per_rank if "embedding" in r[name]["tied"][0]}
    heads = {r[name]["coords"]: r[name]["tied"] for r in per_rank if "head" in r[name]["tied"][0]}
    assert len(embeddings) == len(heads) == 4  # the first and the last stage of each (dp, tp)
    for coords, steps in embeddings.items():
        assert len(steps) == 2
        for mine, theirs in zip(steps, heads[coords], strict=True):
            assert torch.equal(mine["embedding"], theirs["head"])
    # the pair moved off its start: equality is not the untouched checkpoint's
    assert not torch.equal(embeddings[0, 0][0]["embedding"], embeddings[0, 0][1]["embedding"])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_each_rank_reads_only_its_own_blocks(world, name):
    models, _, per_rank, _, _ = world[:5]
    whole = sum(p.numel() for p in models[name].parameters())
    for r in per_rank:
        assert r[name]["read"] == r[name]["held"]  # exactly its local shards, nothing more
        assert r[name]["read"] < whole / 2  # a pipeline stage's tensor-parallel half of it


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_state_trained_at_3d_exports_to_transformers(world, name):
    from trainyard.parallel.io.export import export_hf, export_model, load_exported
    from transformers import AutoModelForCausalLM

    _, configs, per_rank, root, _ = world[:5]
    cfg = configs[name]
    exported = export_model(cfg, checkpoint.step_dir(root / name, 1), 1, root / f"{name}.safetensors")
    out = export_hf(exported, root / f"{name}-hf", max_shard_bytes=50_000)
    theirs, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.eval()
    ours = load_exported(exported)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.lm_head(ours.ln_f(ours(tokens))), rtol=0, atol=ATOL)
    second = {r[name]["losses"][1] for r in per_rank if r[name]["losses"][1] is not None}
    assert abs(second.pop() - hf_loss(theirs, cfg, 1)) < ATOL  # the layout's own forward, after its step


def _lora_twin(name: str) -> str:
    """The one-rank run a LoRA run follows: the same base, and the same precision."""
    if not name.startswith("lora4-"):
        return "lora-one"
    return "lora4-one-bf16" if "bf16" in name else "lora4-one"


def test_lora_follows_its_one_rank_twin_with_the_base_frozen_and_the_adapters_state_alone(world):
    from trainyard.parallel.plan.memory.estimate import rank_memory
    from trainyard.parallel.plan.reduction_bytes import reduction_bytes

    runs = world[4]
    for name, (plan, results) in runs.items():
        twin = next(r.stats for r in runs[_lora_twin(name)][1])
        if name == "lora-resumed":  # step 2 alone, from lora-3d's checkpoint after step 1
            twin = twin[1:]
        losses = [[s["loss"] for s in r.stats] for r in results if r.stats[0]["loss"] is not None]
        for mine in losses:
            assert max(abs(a - b["loss"]) for a, b in zip(mine, twin, strict=True)) < 1e-4, name
        for rank, r in enumerate(results):
            assert r.probe["frozen"] > 0 and r.probe["unchanged"], (name, rank)
            assert set(r.probe["optimizer_bytes"]) == {rank_memory(plan, rank).optimizer}, (name, rank)
            # the adapters alone are reduced, as `trainyard plan` says
            sent = reduction_bytes(plan)["per_stage"][plan.coords(rank).pp]["sent"]
            assert [s["reduce_bytes"] for s in r.stats] == pytest.approx([sent] * len(r.stats), rel=0.01), name
    for twin_name in [t for t in ("lora-one", "lora4-one", "lora4-one-bf16") if t in runs]:
        twin = next(r.stats for r in runs[twin_name][1])
        assert twin[1]["loss"] < twin[0]["loss"], twin_name  # the adapters learn


def test_the_lora_state_trained_at_3d_exports_to_peft_and_merged_to_transformers(world):
    from peft import PeftModel
    from trainyard.parallel.io.export import export_hf, export_model, export_peft, load_exported
    from transformers import AutoModelForCausalLM

    models, _, _, root, runs = world[:5]
    plan, results = runs["lora-3d"]
    exported = export_model(plan.config, checkpoint.step_dir(root / "lora-3d", 1), 1, root / "lora.safetensors")
    ours = load_exported(exported)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.lm_head(ours.ln_f(ours(tokens)))
        assert (expected - models["llama"](tokens).logits).abs().max() > 1e-4  # the step moved the adapters
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "llama-src"),
                                            export_peft(exported, root / "lora-peft")).eval()
        torch.testing.assert_close(adapted(tokens).logits, expected, rtol=0, atol=ATOL)
        merged = AutoModelForCausalLM.from_pretrained(export_hf(exported, root / "lora-hf")).eval()
        torch.testing.assert_close(merged(tokens).logits, expected, rtol=0, atol=ATOL)
    second = {r.stats[1]["loss"] for r in results if r.stats[1]["loss"] is not None}
    assert abs(second.pop() - hf_loss(merged, plan.config, 1)) < ATOL  # the layout's own forward, after its step


BACKEND_STEPS = 3
BACKEND_LAYOUTS = {"z3": {"dp": 2, "zero": 3}, "one": {}}
RESUMED = "gemma2"


def _backend_runs(root: Path):
    """The transformers backend's runs in this world: per architecture at dp2 with ZeRO-3 and recompute (saving after
    step 1) and at dp1, then Gemma 2 at dp1 resumed from the dp2 run's step-1 checkpoint (after it, in the world's
    order)."""
    models = {name: tiny_backend(name, root / f"{name}-src") for name in BACKEND_ARCHITECTURES}
    configs = {}
    for name in models:
        for layout, par in BACKEND_LAYOUTS.items():
            spec = tiny_spec(init_from={"hf": str(root / f"{name}-src")}, global_batch=4, steps=BACKEND_STEPS,
                             parallel=par, optimizer={"lr": 1e-2, "warmup_steps": 0},
                             activation_checkpointing="full" if par else "none")
            spec["model"] = {"seq_len": 16}  # the architecture comes from config.json
            configs[name, layout] = parse_submitted_spec(spec)
    runs = {key: PlanRun(make_plan(cfg), save_after=(1,) if key[1] == "z3" else (), root=str(root / "-".join(key)))
            for key, cfg in configs.items()}
    # one resume (the tied Gemma 2): every architecture's checkpoint names are read back by its export test
    runs[RESUMED, "resumed"] = PlanRun(make_plan(configs[RESUMED, "one"]),
                                       resume=(str(checkpoint.step_dir(root / f"{RESUMED}-z3", 1)), 1))
    return models, configs, runs


@pytest.mark.parametrize("name", BACKEND_ARCHITECTURES)
def test_backend_first_loss_is_transformers_and_dp2_zero3_follows_one_rank(world, name):
    models, configs, curves = world[5]
    assert configs[name, "one"].model.family == "hf"  # no native family reads it
    one, z3 = curves[name, "one"][0], curves[name, "z3"]
    assert abs(one[0] - hf_loss(models[name], configs[name, "one"], 0)) < ATOL
    for rank in z3:
        assert len(rank) == BACKEND_STEPS
        assert max(abs(a - b) for a, b in zip(rank, one, strict=True)) < CURVE_ATOL
    assert one[-1] < one[0]  # it learns


def test_backend_resume_at_another_dp_continues_the_curve(world):
    _, _, curves = world[5]
    resumed, z3 = curves[RESUMED, "resumed"][0], curves[RESUMED, "z3"][0]
    assert len(resumed) == BACKEND_STEPS - 1  # steps 1 and 2
    assert max(abs(a - b) for a, b in zip(resumed, z3[1:], strict=True)) < CURVE_ATOL


@pytest.mark.parametrize("name", BACKEND_ARCHITECTURES)
def test_backend_export_loads_in_transformers_with_trainyards_logits(world, name):
    from trainyard.parallel.io.export import export_hf, export_model, load_exported
    from transformers import AutoModelForCausalLM

    root, (_, configs, curves) = world[3], world[5]
    cfg = configs[name, "z3"]
    exported = export_model(cfg, checkpoint.step_dir(root / f"{name}-z3", 1), 1, root / f"{name}.safetensors")
    theirs, info = AutoModelForCausalLM.from_pretrained(export_hf(exported, root / f"{name}-hf"),
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs.eval()
    ours = load_exported(exported).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours.logits(ours(tokens))  # the model's own head (Gemma 2's final logit soft-capping)
        torch.testing.assert_close(theirs(tokens).logits, logits, rtol=0, atol=ATOL)
    assert abs(curves[name, "z3"][0][1] - hf_loss(theirs, cfg, 1)) < ATOL  # the trained state, exported
