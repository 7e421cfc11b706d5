"""The job's configuration as frozen dataclasses: the JobSpec a user writes, typed.

These dataclasses are the single definition of the JobSpec. `api/` validates incoming JSON/YAML against
them with pydantic (the field rules below: types, ranges, unknown fields) and everything after that
receives them frozen. Rules that relate several fields (divisibility, capabilities, cluster fit) live in
`parallel.plan`, which names the rule it enforces.

Plain dataclasses (not pydantic models) so that `parallel/` stays free of web types; pydantic reads the
`Annotated` constraints and `__pydantic_config__` when it validates (the checkpoint's config gives the
field `async_` its spec name, `async`, a Python keyword).

(Over 400 lines: it is the whole JobSpec, one small dataclass per section with a docstring per field; split
across files, the one schema a user reads would be scattered.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen


class _NotBool:
    """The last item of a number's `Annotated`: the field refuses a boolean, which pydantic's lax mode reads as 1 or
    0 (`steps: true` was one step, `parallel.zero: true` ZeRO-1; YAML 1.1's yes, no, on, off are booleans too). A
    number written as a string stays a number: PyYAML reads `lr: 3e-4` and `1e3` as strings. pydantic calls the hook
    as it builds its validator, so this module imports no pydantic (a rank imports it with torch alone). Last,
    because bounds after it would wrap a validator function, which drops them from the JSON schema."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Callable[[Any], Any]) -> Any:
        from pydantic_core import PydanticCustomError, core_schema

        kind, what = ("float_type", "a valid number") if source is float else ("int_type", "a valid integer")

        def refuse_bool(value: object) -> object:
            if isinstance(value, bool):
                raise PydanticCustomError(kind, f"Input should be {what}, not a boolean")
            return value

        return core_schema.no_info_before_validator_function(refuse_bool, handler(source))


NOT_BOOL = _NotBool()

# Every number a spec carries is bounded: integers so that sums and products of them stay far inside int64
# (the store's INTEGER and torch's index type) and every loop a plan runs stays small, floats finite (JSON
# has no Infinity or NaN). A bound here is generous; the plan's rules (cluster fit, memory) are the real limits.
MAX_STEPS = 10**9
"""More steps than any job runs; also bounds warm-up and checkpoint intervals."""
MAX_DEGREE = 2**16
"""Any one parallel degree, and the number of workers of a job."""
MAX_GLOBAL_BATCH = 2**24
MAX_SEQ_LEN = 2**20
MAX_PRIORITY = 10**6

Degree = Annotated[int, Gt(0), Le(MAX_DEGREE), NOT_BOOL]
Steps = Annotated[int, Ge(0), Le(MAX_STEPS), NOT_BOOL]
# an unknown field is an error, never silently ignored; inf and nan are refused like any other bad value
_STRICT = {"extra": "forbid", "allow_inf_nan": False}

ScheduleKind = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"]


class RuleError(ValueError):
    """A JobSpec that breaks a rule. `field` is the dotted path of the field to change."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)  # both in args, so the error pickles across Ray processes
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    __pydantic_config__ = _STRICT
    experts: Annotated[int, Gt(0), Le(4096), NOT_BOOL]
    """Experts per MoE layer."""
    top_k: Annotated[int, Gt(0), Le(4096), NOT_BOOL] = 2
    """Experts each token is routed to; their gate weights are renormalised to sum to 1."""
    every: Annotated[int, Gt(0), Le(4096), NOT_BOOL] = 2
    """Every `every`-th block is an MoE block (blocks every-1, 2*every-1, ...; 1: all of them)."""
    capacity_factor: Annotated[float, Gt(0), Le(1e3), NOT_BOOL] | None = None
    """null: dropless (every token reaches its experts). A number caps each expert's tokens per sequence at
    ceil(capacity_factor x seq_len x top_k / experts), earlier positions first; a token over the cap skips
    that expert and keeps its residual."""
    aux_loss_coef: Annotated[float, Ge(0), Le(1e3), NOT_BOOL] = 0.01
    """Weight of the Switch/GShard load-balancing loss."""
    z_loss_coef: Annotated[float, Ge(0), Le(1e3), NOT_BOOL] = 0.001
    """Weight of the router z-loss (ST-MoE): the squared log-sum-exp of the router logits."""


@dataclass(frozen=True, kw_only=True)
class RopeScalingConfig:
    """Llama 3's rotary-frequency scaling (transformers' `rope_type: llama3`): low frequencies are divided by
    `factor`, high ones kept, the band between interpolated smoothly."""

    __pydantic_config__ = _STRICT
    rope_type: Literal["llama3"] = "llama3"
    """The only scaling trainyard implements; any other type is refused."""
    factor: Annotated[float, Ge(1), Le(1e6), NOT_BOOL] = 8.0
    """How much longer the extended context is than the original one."""
    low_freq_factor: Annotated[float, Gt(0), Le(1e6), NOT_BOOL] = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`."""
    high_freq_factor: Annotated[float, Gt(0), Le(1e6), NOT_BOOL] = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept as they are."""
    original_max_position_embeddings: Annotated[int, Gt(0), Le(MAX_SEQ_LEN), NOT_BOOL] = 8192
    """The context the frequencies were trained for before scaling."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    __pydantic_config__ = _STRICT
    n_layer: Annotated[int, Gt(0), Le(4096), NOT_BOOL]
    """Transformer blocks."""
    n_head: Annotated[int, Gt(0), Le(4096), NOT_BOOL]
    """Attention heads per block."""
    d_model: Annotated[int, Gt(0), Le(2**17), NOT_BOOL]
    """Hidden size."""
    vocab_size: Annotated[int, Gt(0), Le(2**32), NOT_BOOL] = 256
    """Token ids are in [0, vocab_size). Byte-level text needs 256; uint32 token files hold up to 2**32."""
    seq_len: Annotated[int, Gt(0), Le(MAX_SEQ_LEN), NOT_BOOL] = 64
    """Tokens per training sequence."""
    context_len: Annotated[int, Gt(0), Le(MAX_SEQ_LEN), NOT_BOOL] | None = None
    """Positions the model can attend over (position-embedding rows); null means seq_len."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head (nanoGPT style)."""
    moe: MoEConfig | None = None
    """Mixture-of-experts blocks; null for a dense model."""
    family: Literal["gpt2", "llama"] = "gpt2"
    """The model family (`parallel.models`): gpt2 (LayerNorm, GELU, learned positions, biases) or llama
    (RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases)."""
    n_kv_head: Annotated[int, Gt(0), Le(4096), NOT_BOOL] | None = None
    """Key/value heads (grouped-query attention, llama); null: n_head. Must divide n_head."""
    ffn_hidden: Annotated[int, Gt(0), Le(2**20), NOT_BOOL] | None = None
    """Hidden size of the feed-forward part (and of each expert); null: 4 x d_model for gpt2, Llama's rule
    for llama (8 x d_model / 3 rounded up to a multiple of 256)."""
    rope_theta: Annotated[float, Gt(0), Le(1e12), NOT_BOOL] = 10000.0
    """Base of the rotary embedding's frequencies (llama)."""
    norm_eps: Annotated[float, Gt(0), Le(1), NOT_BOOL] = 1e-5
    """Epsilon of every norm: gpt2's LayerNorms, llama's RMSNorms."""
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    """gpt2's MLP activation: exact GELU, or the tanh approximation (Hugging Face GPT-2's `gelu_new`). llama
    always uses SwiGLU, and refuses gelu_tanh."""
    rope_scaling: RopeScalingConfig | None = None
    """Llama 3 rope scaling (llama); null: none."""

    @property
    def context(self) -> int:
        return self.context_len if self.context_len is not None else self.seq_len

    def is_moe_block(self, block: int) -> bool:
        """Whether global block `block` is a mixture-of-experts block: every `moe.every`-th one."""
        return self.moe is not None and (block + 1) % self.moe.every == 0

    @property
    def moe_blocks(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.is_moe_block(i)]


@dataclass(frozen=True, kw_only=True)
class DataSource:
    __pydantic_config__ = _STRICT
    path: Annotated[str, MinLen(1), MaxLen(4096)]
    """A tokens file or a `trainyard prepare` directory."""
    weight: Annotated[float, Gt(0), Le(1e9), NOT_BOOL] = 1.0
    """Relative share of the samples drawn from this source (weights need not sum to 1)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    __pydantic_config__ = _STRICT
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


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    __pydantic_config__ = _STRICT
    lr: Annotated[float, Gt(0), Le(1e3), NOT_BOOL] = 1e-3
    """Peak learning rate (AdamW)."""
    weight_decay: Annotated[float, Ge(0), Le(1e3), NOT_BOOL] = 0.1
    """Decoupled weight decay, applied to matrices only (not biases, norms)."""
    beta1: Annotated[float, Ge(0), Le(1), NOT_BOOL] = 0.9
    """AdamW's first-moment decay (below 1 with adamw, adamw8bit); sgd's momentum."""
    beta2: Annotated[float, Ge(0), Le(1), NOT_BOOL] = 0.95
    """AdamW's second-moment decay (below 1 with adamw, adamw8bit)."""
    warmup_steps: Steps = 10
    """Linear warm-up from 0 to `lr`; afterwards cosine decay to `min_lr_ratio * lr` at the last step."""
    min_lr_ratio: Annotated[float, Ge(0), Le(1), NOT_BOOL] = 0.1
    grad_clip: Annotated[float, Ge(0), Le(1e9), NOT_BOOL] = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    kind: Literal["adamw", "adamw8bit", "adafactor", "sgd"] = "adamw"
    """Which optimizer (`parallel.optim.kinds.OPTIMIZERS`): its update and the state it keeps per parameter.
    adamw8bit: AdamW with block-wise 8-bit moments (torchao); adafactor: factored second moments, no first
    moment, update clipping, `lr` a step relative to each tensor's RMS (`parallel.optim.adafactor`); sgd: SGD with
    momentum `beta1` (0: plain SGD), linear in the gradient."""
    offload: bool = False
    """ZeRO-Offload: the optimizer's state lives in (pinned) host memory and its step runs on the CPU."""


@dataclass(frozen=True, kw_only=True)
class DpRange:
    """An elastic data-parallel size: the job starts once `min` replicas fit, grows (up to `max`) when free
    resources appear and shrinks (down to `min`) when a node is lost."""

    __pydantic_config__ = _STRICT
    min: Degree
    max: Degree


@dataclass(frozen=True, kw_only=True)
class GradCompressionConfig:
    """PowerSGD (Vogels et al. 2019) on the data-parallel reduction: each large enough gradient matrix is sent
    as two rank-`rank` factors, with error feedback (`parallel.runtime.powersgd`)."""

    __pydantic_config__ = _STRICT
    kind: Literal["powersgd"] = "powersgd"
    """The compressor (the only one so far)."""
    rank: Annotated[int, Gt(0), Le(4096), NOT_BOOL] = 4
    """Rank of the approximation of each gradient matrix (a matrix of min(rows, cols) <= rank is exact)."""
    warmup_steps: Steps = 0
    """Steps reduced uncompressed first (the gradients change fastest early; torch's start_powerSGD_iter)."""
    min_compression_rate: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] = 2.0
    """A matrix is compressed only when its elements exceed (rows + cols) x rank by this factor (torch's
    default 2); the others, and every 1-D tensor, are reduced uncompressed. 0 compresses every matrix."""


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """How data-parallel replicas (each a whole pp x tp group) keep in step (`parallel.sync`)."""

    __pydantic_config__ = _STRICT
    kind: Literal["allreduce", "local_sgd", "diloco"] = "allreduce"
    """allreduce: gradients summed every step; local_sgd: each replica steps on its own share of the batch and
    the parameters are averaged every `every` steps; diloco: the averaged change since the last sync (the
    pseudo-gradient) goes through an outer Nesterov SGD (`parallel.sync`)."""
    every: Annotated[int, Gt(0), Le(MAX_STEPS), NOT_BOOL] = 1
    """local_sgd, diloco: steps between synchronisations (H)."""
    outer_lr: Annotated[float, Gt(0), Le(1e3), NOT_BOOL] = 0.7
    """diloco: the outer SGD's learning rate (DiLoCo's 0.7)."""
    outer_momentum: Annotated[float, Ge(0), Lt(1), NOT_BOOL] = 0.9
    """diloco: the outer SGD's Nesterov momentum (0: plain SGD)."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    __pydantic_config__ = _STRICT
    dp: Degree | DpRange = 1
    """Data-parallel replicas, or a range {min, max} to scale within (`microbatches` is then per rank at
    `min`; the global batch stays the same at every size)."""
    pp: Degree = 1
    """Pipeline stages (pipeline ranks)."""
    tp: Degree = 1
    """Tensor-parallel shards."""
    ep: Degree = 1
    """Expert-parallel ranks, carved out of dp: each hosts experts / ep experts of every MoE layer."""
    vpp: Degree = 1
    """Virtual pipeline chunks per pipeline rank (interleaved-1f1b; zbv needs 2)."""
    sp: bool = False
    """Sequence parallelism (with tp)."""
    microbatches: Annotated[int, Gt(0), Le(MAX_GLOBAL_BATCH), NOT_BOOL] = 1
    """Micro-batches per step on each data-parallel rank (gradient accumulation, pipeline depth)."""
    schedule: ScheduleKind = "1f1b"
    """Pipeline schedule."""
    stage_layers: Annotated[list[Annotated[int, Gt(0), Le(4096), NOT_BOOL]], MinLen(1), MaxLen(4096)] | None = None
    """Blocks per virtual stage, in order (pp * vpp entries summing to n_layer); null splits evenly."""
    zero: Annotated[Literal[0, 1, 2, 3], NOT_BOOL] = 0
    """1: ZeRO-1, each data-parallel rank keeps the optimizer state of its shard of the parameters only
    (gradients reduce-scattered, parameters all-gathered after the step); 2: ZeRO-2, the reduced gradients
    too; 3: ZeRO-3, the parameters too, gathered one block at a time around its forward and backward."""
    overlap_reduce: bool = True
    """Start each gradient bucket's reduction during backward, as soon as its gradients are final."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Type of the gradients on the wire between data-parallel ranks; bf16 halves the traffic."""
    grad_compression: GradCompressionConfig | None = None
    """Compress the gradients on the wire (`{kind: powersgd, rank: 4, warmup_steps: 10}`); null: none."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """How the replicas keep in step: every step (allreduce) or every H steps (local_sgd, diloco)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    # `async` is a Python keyword: the field is `async_`, read and written as `async`.
    __pydantic_config__ = {**_STRICT, "alias_generator": lambda name: name.rstrip("_"), "validate_by_name": True,
                           "validate_by_alias": True, "serialize_by_alias": True}
    every: Steps = 0
    """Save every N steps (0: only the final state, when the job ends)."""
    keep: Annotated[int, Gt(0), Le(1000), NOT_BOOL] = 3
    """Checkpoints kept, the newest."""
    path: Annotated[str, MaxLen(4096)] | None = None
    """Directory holding a folder per job; null: `checkpoints/` in the service's state directory."""
    async_: bool = False
    """Save without blocking the step loop (DCP async save): only staging the state blocks."""


@dataclass(frozen=True, kw_only=True)
class ResumeConfig:
    __pydantic_config__ = _STRICT
    job_id: Annotated[str, MinLen(1), MaxLen(64)]
    """The job whose checkpoint to start from; its model and optimizer must equal this spec's."""
    step: Steps | None = None
    """Its checkpoint of this step; null: its latest."""


@dataclass(frozen=True, kw_only=True)
class InitFromConfig:
    __pydantic_config__ = _STRICT
    hf: Annotated[str, MinLen(1), MaxLen(4096)]
    """A local Hugging Face checkpoint directory (config.json and model.safetensors, or shards with
    model.safetensors.index.json) of GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM. The model's
    architecture comes from its config.json (`model` may leave it out); training starts from its weights."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    __pydantic_config__ = _STRICT
    every: Steps = 0
    """Compute val_loss every N steps and at the last; 0: never."""
    batches: Annotated[int, Gt(0), Le(10_000), NOT_BOOL] = 4
    """Batches of global_batch validation sequences per evaluation."""


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    __pydantic_config__ = _STRICT
    max_failures: Annotated[int, Ge(0), Le(1000), NOT_BOOL] = 3
    """Failures (a rank that raises, dies or hangs) the job recovers from, each from a live replica's state or
    its latest checkpoint; the next one fails the job. 0: the first failure fails the job (a deterministic
    error is then not retried)."""
    step_timeout_s: Annotated[float, Gt(0), Le(7 * 24 * 3600), NOT_BOOL] = 300.0
    """A step that takes longer has hung, whatever its history (a hung collective never hangs the service)."""
    hang_factor: Annotated[float, Gt(1), Le(1e4), NOT_BOOL] = 10.0
    """After a few steps, a step longer than hang_factor x the median of the recent ones has hung..."""
    hang_floor_s: Annotated[float, Gt(0), Le(7 * 24 * 3600), NOT_BOOL] = 5.0
    """...and longer than this: short steps vary too much for a ratio alone."""
    node_grace_s: Annotated[float, Ge(0), Le(7 * 24 * 3600), NOT_BOOL] = 30.0
    """Elastic jobs: how long the resources of a lost node may take to come back before the job shrinks."""
    grow_interval_s: Annotated[float, Gt(0), Le(7 * 24 * 3600), NOT_BOOL] = 10.0
    """Elastic jobs below their max: how often to look for free resources to grow into."""
    from_replica: bool = True
    """Recover from a live data-parallel replica when every (pp, tp) shard still has one holding the state of
    the failed step (no step lost, no checkpoint needed); else, and with false, from the latest checkpoint."""


@dataclass(frozen=True, kw_only=True)
class ResourcesConfig:
    __pydantic_config__ = _STRICT
    gpus_per_worker: Literal["auto"] | Annotated[int, Ge(0), Le(64), NOT_BOOL] = "auto"
    """auto: 1 if the cluster has GPUs, else 0."""
    cpus_per_worker: Annotated[float, Ge(0.0001), Le(4096), NOT_BOOL] = 1.0  # Ray counts resources in 0.0001 units
    """Logical CPUs each rank reserves (also its torch thread count, at least 1)."""


@dataclass(frozen=True, kw_only=True)
class SimCostsConfig:
    __pydantic_config__ = _STRICT
    forward: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] = 1.0
    """Simulated time of one forward of one chunk."""
    backward: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] = 2.0
    """Simulated time of one backward of one chunk."""
    comm: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] = 0.0
    """Simulated time of one communication run (a batch of point-to-point messages sent together)."""
    backward_weight: Annotated[float, Ge(0), Le(1e6), NOT_BOOL] | None = None
    """Of `backward`, the time of the weight-gradient part (a zero-bubble schedule's W; null: half of it); the
    input-gradient part (I) takes the rest, so it must not exceed `backward`."""


@dataclass(frozen=True, kw_only=True)
class PlannerNote:
    """What the planner chose for a spec that said `parallel: auto` (the service writes it on submit)."""

    __pydantic_config__ = _STRICT
    chosen_automatically: bool = True
    """The layout in `parallel` was chosen by the planner (`parallel.plan.planner`), not written by hand."""
    predicted_step_s: Annotated[float, Ge(0), Le(1e9), NOT_BOOL] | None = None
    """The step time the planner's cost model predicted; the job's metrics rows carry it beside the measured."""
    node_type: Annotated[str, MaxLen(256)] | None = None
    """The node type whose calibration the prediction used."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A training job, as submitted."""

    __pydantic_config__ = _STRICT
    model: ModelConfig
    steps: Annotated[int, Gt(0), Le(MAX_STEPS), NOT_BOOL]
    """Optimizer steps to run."""
    name: Annotated[str, MinLen(1), MaxLen(128)] = "job"
    seed: Annotated[int, Ge(0), Le(2**63 - 1), NOT_BOOL] = 0
    """Seeds parameter init and the data order; results depend on it, never on the layout."""
    priority: Annotated[int, Ge(-MAX_PRIORITY), Le(MAX_PRIORITY), NOT_BOOL] = 0
    """Queue order: a waiting job with a higher priority is admitted first; equal priorities go in
    submission order."""
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
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
    """The layout, or `auto`: the service's planner (`parallel.plan.planner`) chooses one on submit and stores it."""
    planned: PlannerNote | None = None
    """Set by the planner when it chose the layout (`parallel: auto`); null for a layout written by hand."""
    compile: bool = False
    """torch.compile each transformer block on its own (regional compilation, as torchtitan does; inductor)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume_from: ResumeConfig | None = None
    """Start from another job's checkpoint (at any layout) and continue after its step."""
    init_from: InitFromConfig | None = None
    """Start from a Hugging Face checkpoint's weights (step 0; a resume or a recovery uses its checkpoint)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    sim_costs: SimCostsConfig = field(default_factory=SimCostsConfig)
    """Per-action costs the plan's schedule simulation uses."""
