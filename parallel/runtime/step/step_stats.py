"""What one training step reports: `StepStats` (the rank's numbers for the step, which `RankDriver` returns as a
dict), `StepReport` (what a rank's answer for a step holds, typed: those numbers and what the step added, as the
coordinator reads it), `Save` (a checkpoint asked for after a step) and `DivergedError` (a step whose loss or
gradient norm is not finite, raised as the step's figures are read: one step late,
`parallel.runtime.step.step_figures`). Data only, no torch: the trainer fills them, and the coordinator, which never
imports torch, reads them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float | None
    """Mean token loss of the global batch; only the last pipeline stage knows it (None elsewhere)."""
    grad_norm: float
    lr: float
    compute_s: float
    """Time this rank spent queueing the step (`RankTrainer.queue_step`): on CPU its whole work; on a GPU the host's
    part, the device's coming after."""
    pp_rank: int
    dp_rank: int
    tp_rank: int
    forward_s: float
    backward_s: float
    comm_s: float
    schedule_s: float
    peak_activations: int
    peak_activation_bytes: int
    optimizer_bytes: int
    """Bytes of optimizer state this rank holds on its device (with ZeRO-1, its slice's only; offloaded: 0)."""
    optimizer_host_bytes: int
    """Offloaded: bytes of optimizer state and of the host copies of parameters and gradients in host memory."""
    early_reductions: int
    """Gradient buckets whose reduction started during backward (overlapped), of `buckets`."""
    buckets: int
    """Bytes of AdamW state this rank holds (with ZeRO-1, its slice's only)."""
    reduce_bytes: int
    """Bytes this rank handed to the step's gradient reductions (payload; compressed with a grad_compression)."""
    compile_s: float
    """Seconds torch.compile spent compiling during this step (`compile: true`; the first steps)."""
    moe: dict[str, dict]
    """Per MoE block of this rank's stage (global index): aux_loss, z_loss, dropped_fraction and load (tokens
    routed to each expert), summed over the stage's ranks. Empty for a dense model."""
    cross_replica_bytes: int = 0
    """Bytes this rank all-reduced across the data-parallel replicas in this step (gradients with allreduce,
    parameters at a local_sgd or diloco sync; `parallel.sync`)."""
    ps_staleness: int | None = None
    """parameter_server: the staleness of the parameters this rank computed the step on (how many steps of the
    slowest replica's updates they missed: 0 under BSP, at most `staleness` under SSP)."""
    ps_wait_s: float | None = None
    """parameter_server: seconds this rank waited pulling the next step's parameters (the clock, the transfer)."""

    def to_dict(self) -> dict:
        return asdict(self)


STATS_FIELDS = frozenset(f.name for f in fields(StepStats))


@dataclass(frozen=True)
class StepReport:
    """A rank's answer for one step, typed: `RankDriver.queue_step`'s dict (and `flush`'s) as `of` reads it. The
    rank's `StepStats`, or None when its replica sat the step out or only rejoined at the step's sync (local_sgd,
    diloco while a replica is dropped), and what the step added: the samples (whole examples), the validation
    loss, the checkpoint written after it, and the rank's resident peak (the Worker actor's)."""

    step: int
    dp_rank: int
    stats: StepStats | None = None
    sat_out: bool = False
    """The rank's replica sat the step out (no figures)."""
    rejoined: bool = False
    """The rank's replica only took part in the step's sync, rejoining the round (no figures but its sync's)."""
    rejoin_bytes: int = 0
    """A rank that rejoined: the bytes it all-reduced in the sync (one that stepped: `stats.cross_replica_bytes`)."""
    sample_ids: list[int] | None = None
    """`data.packing`: the step's sample ids of this rank."""
    epoch: int | None = None
    """`data.packing`: the epochs done."""
    val_loss: float | None = None
    checkpoint_blocked_s: float | None = None
    """How long the checkpoint after the step blocked it (a checkpoint was written)."""
    checkpoint_error: str | None = None
    """Why the checkpoint after the step could not be written."""
    peak_rss_bytes: int | None = None
    """The rank process's resident high-water mark so far (None: not measured, e.g. figures kept for a recovery)."""

    @property
    def cross_replica_bytes(self) -> int:
        """The bytes the rank all-reduced across the data-parallel replicas in the step (`parallel.sync`)."""
        return self.stats.cross_replica_bytes if self.stats is not None else self.rejoin_bytes

    @classmethod
    def of(cls, figures: dict[str, Any], peak_rss_bytes: int | None = None) -> StepReport:
        """The report of a step's dict as `RankDriver.queue_step` returns it (the StepStats' fields and what the step
        added; a rank that sat out or rejoined has no StepStats but `step`, `dp_rank` and its flag). A key it does
        not know raises (TypeError): the dict and the report keep the same fields."""
        extra = {k: v for k, v in figures.items() if k not in STATS_FIELDS}
        if "pp_rank" in figures:
            stats = StepStats(**{k: v for k, v in figures.items() if k in STATS_FIELDS})
            return cls(step=stats.step, dp_rank=stats.dp_rank, stats=stats, peak_rss_bytes=peak_rss_bytes, **extra)
        rejoin_bytes = figures.get("cross_replica_bytes", 0)
        return cls(step=figures["step"], dp_rank=figures["dp_rank"], rejoin_bytes=rejoin_bytes,
                   peak_rss_bytes=peak_rss_bytes, **extra)


@dataclass(frozen=True)
class Save:
    """A checkpoint to write after a step: under `root`, with `info` in its manifest; `background` stages the
    state and lets a thread write it (finished by the next save or `finish`)."""

    root: Path
    info: dict
    background: bool = False


class DivergedError(RuntimeError):
    """A step whose loss or gradient norm is not finite (NaN, infinity): training has diverged, and every later
    step would train on NaN. The rank stops there instead; the message names the step."""
