"""The last pipeline stage's peak activation memory at tp=1 vs tp=2, for a model whose logits dominate.

Run: `python -m bench.tp_memory`, or as the section `tensor` of `make bench` (`python -m bench.run --only
tensor`); spawned gloo ranks on this machine, no Ray; about a minute on 2 cores.

A GPT with a large vocabulary and a short, narrow trunk (vocab 8192, seq_len 128, d_model 64, two blocks)
trains one step with pp=2 (1f1b, two micro-batches) at tp=1, tp=2 and tp=2 with sp. Each rank's
`RankTrainer` reports `peak_activation_bytes`: the most bytes autograd held for backward at once, counted
by the pipeline executor's saved-tensor meter (parameters excluded; a DTensor counts its local shard),
which the service shows as `stage_peak_activation_mb`. The last stage holds the head and the cross-entropy,
so its peak is mostly logits; with the head sharded over the vocabulary and `loss_parallel`, no rank holds
a token's whole row of logits and the peak should fall by about tp.
"""

from __future__ import annotations

from trainyard.parallel.plan import make_plan
from trainyard.parallel.runtime.local_world import PlanRun, run_plans
from trainyard.parallel.spec import parse_spec

from bench.context import BenchContext
from bench.results import Row, ratio

SPEC = {
    "name": "bench-tp-memory",
    "seed": 1234,
    "model": {"n_layer": 2, "n_head": 4, "d_model": 64, "vocab_size": 8192, "seq_len": 128},
    "data": {"kind": "synthetic"},
    "steps": 1,
    "global_batch": 8,
    "resources": {"gpus_per_worker": 0},
}
LAYOUTS = {"tp=1": {"tp": 1}, "tp=2": {"tp": 2}, "tp=2 sp": {"tp": 2, "sp": True}}
PIPELINE = {"pp": 2, "microbatches": 2, "schedule": "1f1b"}


def stage_peaks_mb(layouts: dict[str, dict]) -> dict[str, list[float]]:
    """Peak saved-activation MB of each pipeline stage (tp rank 0; its peers hold the same), per layout; every
    layout's one step in one spawned world (`parallel.runtime.local_world`)."""
    plans = [make_plan(parse_spec({**SPEC, "parallel": {**PIPELINE, **parallel}}))
             for parallel in layouts.values()]
    out = {}
    for name, ranks in zip(layouts, run_plans([PlanRun(plan) for plan in plans]), strict=True):
        stats = [r.stats[0] for r in ranks]
        by_stage = sorted((s for s in stats if s["dp_rank"] == 0 and s["tp_rank"] == 0), key=lambda s: s["pp_rank"])
        out[name] = [s["peak_activation_bytes"] / 2**20 for s in by_stage]
    return out


def run_section(ctx: BenchContext) -> list[Row]:
    peaks = stage_peaks_mb(LAYOUTS)
    base = peaks["tp=1"]
    for name, per_stage in peaks.items():
        ctx.log(f"{name}: peak saved activations per stage {[round(mb, 2) for mb in per_stage]} MB")
    m = SPEC["model"]
    note = (f"GPT vocab {m['vocab_size']}, seq_len {m['seq_len']}, d_model {m['d_model']}, {m['n_layer']} blocks, "
            f"pp=2 1f1b, 2 micro-batches of 4; baseline tp=1")
    return [Row(f"last-stage peak activation memory, {name} vs tp=1 (MB)", peaks[name][-1], base[-1],
                ratio(peaks[name][-1], base[-1]), "MB", note) for name in ("tp=2", "tp=2 sp")] + [
            Row(f"first-stage peak activation memory, {name} vs tp=1 (MB)", peaks[name][0], base[0],
                ratio(peaks[name][0], base[0]), "MB", note) for name in ("tp=2", "tp=2 sp")]


def main() -> None:
    m = SPEC["model"]
    print(f"model: vocab {m['vocab_size']}, seq_len {m['seq_len']}, d_model {m['d_model']}, {m['n_layer']} blocks; "
          f"pp={PIPELINE['pp']} {PIPELINE['schedule']}, {PIPELINE['microbatches']} micro-batches of "
          f"{SPEC['global_batch'] // PIPELINE['microbatches']} sequences")
    peaks = stage_peaks_mb(LAYOUTS)
    base = peaks["tp=1"][-1]
    for name, per_stage in peaks.items():
        stages = ", ".join(f"stage {i}: {mb:.2f} MB" for i, mb in enumerate(per_stage))
        print(f"{name:8} {stages}; last stage vs tp=1: {per_stage[-1] / base:.3f}")


if __name__ == "__main__":
    main()
