"""The job's configuration as frozen dataclasses: the JobSpec a user writes, typed.

These dataclasses are the single definition of the JobSpec. `api/` validates incoming JSON/YAML against
them with pydantic (the field rules below: types, ranges, unknown fields) and everything after that
receives them frozen. Rules that relate several fields (divisibility, capabilities, cluster fit) live in
`parallel.plan`, which names the rule it enforces.

Plain dataclasses (not pydantic models) so that `parallel/` stays free of web types; pydantic reads the
`Annotated` constraints and `__pydantic_config__` when it validates (the checkpoint's config gives the
field `async_` its spec name, `async`, a Python keyword).

This module is the JobSpec's one import point: it holds the top (`JobConfig`, `PlannerNote`) and re-exports
every name of its sections, one module per group of sections, each small enough to read at once:
`parallel.config.fields` (bounds, the number types, `RuleError`), `parallel.config.model` (`model`),
`parallel.config.training` (`data`, `optimizer`, `eval`, `checkpoint`, `resume_from`, `init_from`) and
`parallel.config.parallelism` (`parallel`, `fault`, `resources`, `sim_costs`). Import from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le, MaxLen, MinLen
from trainyard.parallel.config.fields import (
    MAX_DEGREE,
    MAX_GLOBAL_BATCH,
    MAX_PRIORITY,
    MAX_SEQ_LEN,
    MAX_STEPS,
    NOT_BOOL,
    STRICT,
    Degree,
    NotNative,
    RuleError,
    Steps,
)
from trainyard.parallel.config.model import LoraConfig, ModelConfig, MoEConfig, RopeScalingConfig
from trainyard.parallel.config.parallelism import (
    DpRange,
    FaultConfig,
    GradCompressionConfig,
    ParallelConfig,
    ResourcesConfig,
    ScheduleKind,
    SimCostsConfig,
    SyncConfig,
)
from trainyard.parallel.config.training import (
    CheckpointConfig,
    DataConfig,
    DataSource,
    EvalConfig,
    InitFromConfig,
    MlflowConfig,
    OptimizerConfig,
    ResumeConfig,
    TrackingConfig,
    WandbConfig,
)

__all__ = ["CheckpointConfig", "DataConfig", "DataSource", "Degree", "DpRange", "EvalConfig", "FaultConfig",
           "GradCompressionConfig", "InitFromConfig", "JobConfig", "LoraConfig", "MAX_DEGREE", "MAX_GLOBAL_BATCH",
           "MAX_PRIORITY", "MAX_SEQ_LEN", "MAX_STEPS", "MoEConfig", "ModelConfig", "NOT_BOOL", "NotNative",
           "OptimizerConfig", "ParallelConfig", "PlannerNote", "ResourcesConfig", "ResumeConfig", "RopeScalingConfig",
           "RuleError",
           "ScheduleKind", "SimCostsConfig", "Steps", "SyncConfig", "MlflowConfig", "TrackingConfig", "WandbConfig"]



@dataclass(frozen=True, kw_only=True)
class PlannerNote:
    """What the planner chose for a spec that said `parallel: auto` (the service writes it on submit)."""

    __pydantic_config__ = STRICT
    chosen_automatically: bool = True
    """The layout in `parallel` was chosen by the planner (`parallel.plan.planner.planner`), not written by hand."""
    predicted_step_s: Annotated[float, Ge(0), Le(1e9), NOT_BOOL] | None = None
    """The step time the planner's cost model predicted; the job's metrics rows carry it beside the measured."""
    node_type: Annotated[str, MaxLen(256)] | None = None
    """The node type whose calibration the prediction used."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A training job, as submitted."""

    __pydantic_config__ = STRICT
    model: ModelConfig
    """The model: its family and sizes (`init_from.hf` may fill these in from a config.json)."""
    steps: Annotated[int, Gt(0), Le(MAX_STEPS), NOT_BOOL]
    """Optimizer steps to run."""
    name: Annotated[str, MinLen(1), MaxLen(128)] = "job"
    """A label shown in `trainyard list` and the job's status; the job's id is made by the service."""
    seed: Annotated[int, Ge(0), Le(2**63 - 1), NOT_BOOL] = 0
    """Seeds parameter init and the data order; results depend on it, never on the layout."""
    priority: Annotated[int, Ge(-MAX_PRIORITY), Le(MAX_PRIORITY), NOT_BOOL] = 0
    """Queue order: a waiting job with a higher priority is admitted first; equal priorities go in
    submission order."""
    data: DataConfig = field(default_factory=DataConfig)
    """What the job trains (and validates) on."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer, its learning-rate schedule and gradient clipping."""
    global_batch: Annotated[int, Gt(0), Le(MAX_GLOBAL_BATCH), NOT_BOOL] = 8
    """Sequences per optimizer step, fixed across layouts."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: matmuls under bf16 autocast; parameters, gradients and optimizer state stay fp32."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of keeping them: `full` recomputes each block, `selective`
    only the attention core and the MLP's activation (Megatron's choice)."""
    activation_offload: bool = False
    """Keep the blocks' saved activations in (pinned) host memory until backward (torch's `save_on_cpu`)."""
    parallel: ParallelConfig | Literal["auto"] = field(default_factory=ParallelConfig)
    """The layout, or `auto`: the service's planner (`parallel.plan.planner.planner`) chooses one on submit and stores
    it."""
    planned: PlannerNote | None = None
    """Set by the planner when it chose the layout (`parallel: auto`); null for a layout written by hand."""
    compile: bool = False
    """torch.compile each transformer block on its own (regional compilation, as torchtitan does; inductor)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When and where the ranks save sharded checkpoints (a final one is always written)."""
    resume_from: ResumeConfig | None = None
    """Start from another job's checkpoint (at any layout) and continue after its step."""
    init_from: InitFromConfig | None = None
    """Start from a Hugging Face checkpoint's weights (step 0; a resume or a recovery uses its checkpoint)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation loss on data the job does not train on."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """How failures (a rank raising, dying or hanging) are detected and recovered from."""
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """What each rank reserves on the Ray cluster."""
    sim_costs: SimCostsConfig = field(default_factory=SimCostsConfig)
    """Per-action costs the plan's schedule simulation uses."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment trackers the job's coordinator logs each step's metrics (and the spec) to: TensorBoard, W&B,
    MLflow. No rank talks to a tracker."""
