"""The JobSpec's training sections: `data` (with its mixture `sources`), `optimizer`, `eval`, `checkpoint`,
`resume_from`, `init_from` and `tracking` (the experiment trackers the coordinator logs to).

Part of the JobSpec (`parallel.config` re-exports every name); the docstring under each field is its
description in docs/jobspec.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le, MaxLen, MinLen
from trainyard.parallel.config.fields import NOT_BOOL, STRICT, Steps
from trainyard.parallel.names import LrScheduleName, OptimizerName


@dataclass(frozen=True, kw_only=True)
class DataSource:
    __pydantic_config__ = STRICT
    path: Annotated[str, MinLen(1), MaxLen(4096)]
    """A tokens file or a `trainyard prepare` directory."""
    weight: Annotated[float, Gt(0), Le(1e9), NOT_BOOL] = 1.0
    """Relative share of the samples drawn from this source (weights need not sum to 1)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    __pydantic_config__ = STRICT
    kind: Literal["synthetic", "text", "tokens"] = "synthetic"
    """synthetic: seeded random tokens; text: a UTF-8 file as bytes; tokens: flat binary of token ids, or a
    `trainyard prepare` directory."""
    path: Annotated[str, MaxLen(4096)] | None = None
    """File for `text` and `tokens` (or a prepared directory for `tokens`). A relative path is resolved against
    the server's working directory."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a flat `tokens` file (nanoGPT writes uint16); a prepared directory's manifest says its own."""
    val_path: Annotated[str, MaxLen(4096)] | None = None
    """Validation data of the same kind; null: with eval on, the last 5% of `path` (not trained on), or of
    each source of a mixture."""
    sources: Annotated[list[DataSource], MinLen(1), MaxLen(1024)] | None = None
    """`tokens` only, instead of `path`: datasets mixed by weight. The sample at each position of a step's
    global batch is a function of (seed, step, position) alone, as for one dataset."""
    packing: bool | None = None
    """null: a sample is a window of seq_len + 1 tokens starting anywhere in the data (pretraining). false: whole
    examples (the documents of a `trainyard prepare` directory), each padded to its own sequence (one longer
    than seq_len is cut into consecutive pieces), every example seen once per epoch in a shuffled order. true:
    the same examples packed, in order, several to a sequence while their targets fit seq_len, attention kept
    within each and positions restarting at each (not with compile, nor gpt2 with parallel.sp)."""
    epochs: Annotated[int, Gt(0), Le(1_000_000), NOT_BOOL] | None = None
    """With whole examples (`packing` set): passes over them; the job ends after `steps` or the last epoch,
    whichever comes first (the service lowers `steps` at submit, saying so in the job's events)."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    __pydantic_config__ = STRICT
    lr: Annotated[float, Gt(0), Le(1e3), NOT_BOOL] = 1e-3
    """Peak learning rate (AdamW)."""
    weight_decay: Annotated[float, Ge(0), Le(1e3), NOT_BOOL] = 0.1
    """Decoupled weight decay, applied to matrices only (not biases, norms)."""
    beta1: Annotated[float, Ge(0), Le(1), NOT_BOOL] = 0.9
    """AdamW's first-moment decay (below 1 with adamw, adamw8bit, adamw4bit); sgd's momentum."""
    beta2: Annotated[float, Ge(0), Le(1), NOT_BOOL] = 0.95
    """AdamW's second-moment decay (below 1 with adamw, adamw8bit, adamw4bit)."""
    warmup_steps: Steps = 10
    """Linear warm-up from 0 to `lr`; afterwards the `schedule`."""
    schedule: LrScheduleName = "cosine"
    """After warm-up: cosine or linear decay to `min_lr_ratio * lr` at the last step; constant `lr`; or wsd
    (warm-up, stable, decay): `lr` until the last `decay_steps` steps, then linear decay to `min_lr_ratio * lr`
    (`parallel.optim.lr_schedules.LR_SCHEDULES`)."""
    decay_steps: Steps | None = None
    """wsd: the steps of the final decay; null: the last tenth of the job."""
    min_lr_ratio: Annotated[float, Ge(0), Le(1), NOT_BOOL] = 0.1
    """The learning rate at the last step, as a fraction of `lr` (the end of the decay)."""
    grad_clip: Annotated[float, Ge(0), Le(1e9), NOT_BOOL] = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    kind: OptimizerName = "adamw"
    """Which optimizer (`parallel.optim.kinds.OPTIMIZERS`): its update and the state it keeps per parameter.
    adamw8bit, adamw4bit: AdamW with block-wise 8-bit or 4-bit moments (torchao); adafactor: factored second
    moments, no first moment, update clipping, `lr` a step relative to each tensor's RMS (`parallel.optim.adafactor`);
    sgd: SGD with momentum `beta1` (0: plain SGD), linear in the gradient."""
    offload: bool = False
    """ZeRO-Offload: the optimizer's state lives in (pinned) host memory and its step runs on the CPU."""
    offload_overlap: bool = True
    """With `offload`: the CPU step of each block's parameters runs while the next step's forward proceeds
    through the blocks already updated (as ZeRO-Offload does; the same numerics). Only at zero 0 without
    `compile` (ZeRO-1 gathers every parameter right after the step; elsewhere the step completes in place)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    # `async` is a Python keyword: the field is `async_`, read and written as `async`.
    __pydantic_config__ = {**STRICT, "alias_generator": lambda name: name.rstrip("_"), "validate_by_name": True,
                           "validate_by_alias": True, "serialize_by_alias": True}
    every: Steps = 0
    """Save every N steps (0: only the final state, when the job ends)."""
    keep: Annotated[int, Gt(0), Le(1000), NOT_BOOL] = 3
    """Checkpoints kept, the newest."""
    path: Annotated[str, MaxLen(4096)] | None = None
    """Directory holding a folder per job; null: `checkpoints/` in the service's state directory."""
    async_: bool = False
    """Save without blocking the step loop (DCP async save): only staging the state blocks."""
    max_write_failures: Annotated[int, Gt(0), Le(1000), NOT_BOOL] = 3
    """Scheduled checkpoints that may fail to be written in a row (a full disk, a write error) before the job
    fails: each failure is an event, the job trains on from the checkpoints before it and tries again at the
    next interval."""


@dataclass(frozen=True, kw_only=True)
class ResumeConfig:
    __pydantic_config__ = STRICT
    job_id: Annotated[str, MinLen(1), MaxLen(64)]
    """The job whose checkpoint to start from; its model and optimizer must equal this spec's."""
    step: Steps | None = None
    """Its checkpoint of this step; null: its latest."""


@dataclass(frozen=True, kw_only=True)
class InitFromConfig:
    __pydantic_config__ = STRICT
    hf: Annotated[str, MinLen(1), MaxLen(4096)] | None = None
    """A local Hugging Face checkpoint directory (config.json and model.safetensors, or shards with
    model.safetensors.index.json) of GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM. The model's
    architecture comes from its config.json (`model` may leave it out); training starts from its weights."""
    job_id: Annotated[str, MinLen(1), MaxLen(64)] | None = None
    """Instead of `hf`: one of your own ended jobs, whose trained model (as a Hugging Face directory, made once
    beside it) this job starts from. The service resolves it at submit (`hf` is then that directory)."""
    adapter: Annotated[str, MinLen(1), MaxLen(4096)] | None = None
    """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) made for `hf`'s model: its
    adapters start `model.lora`'s (same rank and targets)."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    __pydantic_config__ = STRICT
    every: Steps = 0
    """Compute val_loss every N steps and at the last; 0: never."""
    batches: Annotated[int, Gt(0), Le(10_000), NOT_BOOL] = 4
    """Batches of global_batch validation sequences per evaluation."""


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    __pydantic_config__ = STRICT
    project: Annotated[str, MinLen(1), MaxLen(128)] = "trainyard"
    """The W&B project the job's run goes to (its run id is the job's id; its name the job's name)."""
    entity: Annotated[str, MinLen(1), MaxLen(128)] | None = None
    """The W&B team or user; null: the account's default."""
    mode: Literal["auto", "online", "offline"] = "auto"
    """offline: the run is written under the job's directory (`wandb sync` uploads it later); online: sent as it
    runs; auto: online when W&B has an API key (WANDB_API_KEY, or `wandb login`), else offline."""


@dataclass(frozen=True, kw_only=True)
class MlflowConfig:
    __pydantic_config__ = STRICT
    uri: Annotated[str, MinLen(1), MaxLen(4096)] | None = None
    """The MLflow tracking URI (a server, or a local file store such as `file:///data/mlruns`); null: a file
    store in the job's directory (`mlruns/`)."""
    experiment: Annotated[str, MinLen(1), MaxLen(256)] = "trainyard"
    """The MLflow experiment the job's run goes to (made if it does not exist)."""


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    __pydantic_config__ = STRICT
    tensorboard: bool = False
    """TensorBoard event files under the job's directory (`trainyard tensorboard ID` prints where)."""
    wandb: WandbConfig | None = None
    """A Weights & Biases run (needs `pip install 'trainyard[track]'`)."""
    mlflow: MlflowConfig | None = None
    """An MLflow run (needs `pip install 'trainyard[track]'`)."""
