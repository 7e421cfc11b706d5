"""Section `sync`: replicas that synchronise every H steps (`parallel.sync`: local_sgd, diloco) against
all-reduce data parallelism: the loss reached at equal tokens against the bytes each rank sends across the
replicas per step.

Run: `python -m bench.run --only sync` (`--case NAME` for some variants; their all-reduce references run too), or
`python -m bench.sync [CORPUS [VARIANT ...]]` to print the rows for another text corpus without writing them;
spawned gloo ranks (torch alone, no Ray), every variant a plan of one world of four processes
(`parallel.runtime.local_world.run_plans`), one after the other; a few minutes on 2 cores.

The demo job's model and corpus (examples/demo.yaml: a 4-block byte-level GPT on examples/corpus.txt) at dp=4,
global batch 16, STEPS steps, the same seed, so every variant sees the same samples in the same order: all-reduce,
then diloco (outer_lr 0.7, Nesterov momentum 0.9, DiLoCo's) at every = 1, 4, 8, 16, and local_sgd at every 8;
then all-reduce and diloco every 8 at (dp=2, pp=2). A row per variant: the loss of the synchronised model at
equal tokens, as DiLoCo's paper compares it (the validation loss after the last step, and its mean over the
EVALS points, each a multiple of every H, so one model's) and the training loss of the synchronised model (the
global batch's loss at the SYNCED steps, each the first after a sync), beside the training loss of the inner
steps (the
mean over the last TAIL steps; a local replica's loss is that of its own drifting parameters on its share of
the batch, averaged over the replicas), the bytes each rank all-reduced across the replicas per step (the
payload, `StepStats.cross_replica_bytes`, averaged over the run), and their ratios to all-reduce's.
"""

from __future__ import annotations

from typing import Any

from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.local_world import PlanRun, run_plans
from trainyard.parallel.spec import parse_spec

from bench.context import BENCH, BenchContext
from bench.results import Row, at_most, ratio

STEPS, TAIL = 240, 20
EVALS = (80, 160, 240)
"""Step counts after which the validation loss is taken: multiples of 16, so every variant has just synchronised."""
SYNCED = tuple(range(STEPS - 80, STEPS, 16))
"""Steps whose training loss is the synchronised model's: each follows a sync of every variant (16 is a multiple of
every H), so every replica computes it with the synchronised parameters, before the step's update; their mean
over the replicas is the global batch's loss of that one model."""
SPEC: dict[str, Any] = {
    "name": "bench-sync", "seed": 1234,
    "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "vocab_size": 256, "seq_len": 64},
    "data": {"kind": "text", "path": str(BENCH.parent / "examples" / "corpus.txt")},
    "optimizer": {"lr": 3.0e-3, "weight_decay": 0.1, "warmup_steps": 20, "grad_clip": 1.0},
    "eval": {"every": STEPS, "batches": 4},
    "steps": STEPS, "global_batch": 16,
}
DILOCO = {"kind": "diloco", "outer_lr": 0.7, "outer_momentum": 0.9}
DP4 = {"dp": 4}
PP2 = {"dp": 2, "pp": 2, "microbatches": 2}
VARIANTS: dict[str, tuple[dict, dict]] = {  # name -> (parallel layout, sync)
    "allreduce dp=4": (DP4, {}),
    **{f"diloco every={h} dp=4": (DP4, {**DILOCO, "every": h}) for h in (1, 4, 8, 16)},
    "local_sgd every=8 dp=4": (DP4, {"kind": "local_sgd", "every": 8}),
    "allreduce dp=2 pp=2": (PP2, {}),
    "diloco every=8 dp=2 pp=2": (PP2, {**DILOCO, "every": 8}),
}
REFERENCE = {"dp=4": "allreduce dp=4", "dp=2 pp=2": "allreduce dp=2 pp=2"}
CLAIMED = "diloco every=8 "
"""The variants the issue makes a claim about: the synchronised model's val_loss within CLAIM of all-reduce's."""
CLAIM = 0.03


def _plan(parallel: dict, sync: dict, corpus: str | None = None):
    data = {"data": {"kind": "text", "path": corpus}} if corpus else {}
    return make_plan(parse_spec({**SPEC, **data, "parallel": {**parallel, **({"sync": sync} if sync else {})}}))


def measure(stats_by_rank: list[list[dict]]) -> dict[str, float]:
    """A run's tail training loss, final validation loss and mean cross-replica bytes per step (the most of any
    rank's)."""
    last = [stats for stats in stats_by_rank if stats[0]["loss"] is not None]  # the replicas' last stages
    steps = len(last[0])
    sent = [max(rank[s]["cross_replica_bytes"] for rank in stats_by_rank) for s in range(steps)]
    loss = [sum(rank[s]["loss"] for rank in last) / len(last) for s in range(steps - TAIL, steps)]
    vals = [s["val_loss"] for s in last[0] if s.get("val_loss") is not None]
    synced = [sum(rank[s]["loss"] for rank in last) / len(last) for s in SYNCED]
    return {"loss": sum(loss) / TAIL, "val_loss": vals[-1], "val_mean": sum(vals) / len(vals),
            "synced_loss": sum(synced) / len(synced), "bytes": sum(sent) / len(sent)}


def run_section(ctx: BenchContext, corpus: str | None = None) -> list[Row]:
    """Every variant (or those `--case` names, with their references), on the demo corpus or `corpus`."""
    names = [n for n in VARIANTS if not ctx.cases or n in ctx.cases or n in REFERENCE.values()]
    runs = [PlanRun(_plan(*VARIANTS[name], corpus), evaluate_after=EVALS) for name in names]
    results = run_plans(runs)
    measured = {name: measure([r.stats for r in result]) for name, result in zip(names, results, strict=True)}
    rows = []
    for name, m in measured.items():
        ref = measured[REFERENCE["dp=4" if name.endswith("dp=4") else "dp=2 pp=2"]]
        ctx.log(f"{name}: val_loss {m['val_loss']:.4f} (mean at {EVALS}: {m['val_mean']:.4f}), synchronised "
                f"model's training loss at steps {SYNCED} {m['synced_loss']:.4f}, inner training loss "
                f"{m['loss']:.4f}, {m['bytes']:.0f} B/step")
        rows.append(Row(f"{name}: synchronised model's val_loss after {STEPS} steps", m["val_loss"],
                        ref["val_loss"], ratio(m["val_loss"], ref["val_loss"]), "loss",
                        f"val_loss mean at steps {EVALS} {m['val_mean']:.4f} vs {ref['val_mean']:.4f} (ratio "
                        f"{m['val_mean'] / ref['val_mean']:.3f}); synchronised model's training loss at steps {SYNCED} "
                        f"{m['synced_loss']:.4f} vs {ref['synced_loss']:.4f} (ratio "
                        f"{m['synced_loss'] / ref['synced_loss']:.3f}); inner steps' training loss (mean of the last "
                        f"{TAIL}) {m['loss']:.4f} vs {ref['loss']:.4f} (ratio {m['loss'] / ref['loss']:.3f}); "
                        f"cross-replica bytes per step per rank "
                        f"{m['bytes'] / 2**10:.1f} KiB vs {ref['bytes'] / 2**10:.1f} KiB (ratio "
                        f"{m['bytes'] / ref['bytes']:.3f}); {STEPS} steps, global batch 16, equal tokens",
                        target=at_most(1 + CLAIM, of="ratio") if name.startswith(CLAIMED) else None))
    return rows


if __name__ == "__main__":  # python -m bench.sync [CORPUS [VARIANT ...]]: the rows logged, nothing written
    import sys
    import tempfile
    from pathlib import Path

    run_section(BenchContext(Path(tempfile.mkdtemp()), cases=tuple(sys.argv[2:])),
                sys.argv[1] if len(sys.argv) > 1 else None)
