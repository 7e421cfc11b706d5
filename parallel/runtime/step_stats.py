"""What one training step reports: `StepStats` (the rank's numbers for the step, which reach the coordinator as a
dict) and `DivergedError` (a step whose loss or gradient norm is not finite, raised as the step's figures are
read: one step late, `parallel.runtime.step_figures`). Data only, no torch: the trainer fills them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    """Bytes this rank handed to the step's gradient reductions (payload; compressed with PowerSGD)."""
    compile_s: float
    """Seconds torch.compile spent compiling during this step (`compile: true`; the first steps)."""
    moe: dict[str, dict]
    """Per MoE block of this rank's stage (global index): aux_loss, z_loss, dropped_fraction and load (tokens
    routed to each expert), summed over the stage's ranks. Empty for a dense model."""
    cross_replica_bytes: int = 0
    """Bytes this rank all-reduced across the data-parallel replicas in this step (gradients with allreduce,
    parameters at a local_sgd or diloco sync; `parallel.sync`)."""

    def to_dict(self) -> dict:
        return asdict(self)


class DivergedError(RuntimeError):
    """A step whose loss or gradient norm is not finite (NaN, infinity): training has diverged, and every later
    step would train on NaN. The rank stops there instead; the message names the step."""
