"""A step's metrics row as data: `StepRow`, which the coordinator makes from the ranks' reports
(`actors.telemetry.make_row`), and `MetricsRow`, the model of a row the REST API serves, made from it (the
attribute docstrings are the schema's descriptions). No torch, no Ray: the API imports it."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.dataclasses import dataclass as pydantic_dataclass
from typing_extensions import TypedDict


class MoELayerRow(TypedDict):
    """One MoE layer's statistics in a step's row."""

    aux_loss: float
    """Load-balancing loss (Switch/GShard), mean over the step's sequences: 1 when perfectly balanced."""
    z_loss: float
    """Router z-loss: squared log-sum-exp of the router logits, mean over the step's tokens."""
    dropped_fraction: float
    """Token assignments over capacity (0 when dropless)."""
    load: list[int]
    """Tokens routed to each expert (before capacity); they sum to the step's tokens x top_k."""


@pydantic_dataclass(frozen=True, config=ConfigDict(use_attribute_docstrings=True))
class StepRow:
    """One step's metrics row (`make_row`; the REST API's `MetricsRow` too). The fields without a default are in
    every row; the others only when the step has them (`to_row` leaves the unset ones out)."""

    step: int
    loss: float
    """The mean over the replicas' when they differ (local_sgd, diloco with a replica dropped: each has its own)."""
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_time_s: float
    coordinator_overhead_s: float
    """Wall time between two steps' results that no rank spent computing."""
    bubble_fraction: float
    """The first pipeline's measured bubble: 1 - (time its stages computed) / (pp x the longest stage's span)."""
    stage_forward_s: list[float]
    stage_backward_s: list[float]
    stage_peak_activations: list[int]
    stage_peak_activation_mb: list[float]
    reduce_bytes: int
    """Gradient bytes the busiest rank handed to the step's data-parallel reductions (compressed, with a
    grad_compression)."""
    cross_replica_bytes: int
    """The most any rank all-reduced across the data-parallel replicas (parallel.sync)."""
    peak_rss_bytes: int | None = None
    """The largest rank process's resident memory high-water mark so far, as the OS counts it."""
    compile_s: float | None = None
    """The slowest rank's torch.compile time in this step (`compile: true`), when it compiled."""
    predicted_step_s: float | None = None
    """A layout the planner chose (`parallel: auto`): the step time its cost model predicted, beside step_time_s."""
    moe: dict[str, MoELayerRow] | None = None
    """Per MoE layer (keyed by block index) for a mixture-of-experts model."""
    sample_ids: list[int] | None = None
    """Whole examples (`data.packing`): the global batch's sample ids (sequence indices), in data-parallel rank
    order."""
    epoch: int | None = None
    """Whole examples: the epochs done at the end of the step."""
    val_loss: float | None = None
    """Mean token loss on the validation data, on the steps `eval.every` picks and the last."""
    checkpoint_blocked_s: float | None = None
    """On a step that saved a checkpoint: how long the save held the step up (with async, the staging)."""
    checkpoint_error: str | None = None
    replica_steps: list[int] | None = None
    """local_sgd, diloco: the steps each replica's state holds."""
    ps_staleness: list[int] | None = None
    """parameter_server, by replica: the staleness of the parameters it computed the step on, which its update
    carried (0 under BSP, at most `staleness` under SSP)."""
    ps_pace_s: list[float] | None = None
    """parameter_server, by replica: the seconds its step took (its compute, its push, the wait for the next pull)."""

    def to_row(self) -> dict[str, Any]:
        """The row as the metrics log, the trackers and the service's polls have it."""
        return {name: value for name in _ROW_FIELDS
                if (value := getattr(self, name)) is not None or name in _ALWAYS}


_ROW_FIELDS = tuple(f.name for f in fields(StepRow))
_ALWAYS = frozenset(f.name for f in fields(StepRow) if f.default is MISSING)


SERVED_ALWAYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")
"""The fields every row the service has stored holds (a row an older service wrote may lack the others)."""
MetricsRow: type[BaseModel] = create_model(
    "MetricsRow", __config__=ConfigDict(extra="allow"),
    **{name: (info.annotation if name in SERVED_ALWAYS else info.annotation | None,
              Field(... if name in SERVED_ALWAYS else None, description=info.description))
       for name, info in StepRow.__pydantic_fields__.items()})  # type: ignore[attr-defined, call-overload]
"""A row as the REST API serves it: StepRow's fields and descriptions, all but `SERVED_ALWAYS` optional."""
