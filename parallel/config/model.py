"""The JobSpec's `model` section: the family and its sizes, mixture-of-experts blocks, Llama 3's rope scaling,
LoRA adapters.

Part of the JobSpec (`parallel.config` re-exports every name); the docstring under each field is its
description in docs/jobspec.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from annotated_types import Ge, Gt, Le, MaxLen, MinLen
from trainyard.parallel.config.fields import CONFIG_JSON, MAX_SEQ_LEN, NOT_BOOL, STRICT
from trainyard.parallel.names import FamilyName


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    __pydantic_config__ = STRICT
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
    norm_topk_prob: bool = True
    """Renormalise each token's top_k router probabilities to sum to 1 (Mixtral; Qwen3-MoE's `norm_topk_prob`);
    false weighs the experts' outputs by the plain softmax probabilities."""


@dataclass(frozen=True, kw_only=True)
class RopeScalingConfig:
    """Llama 3's rotary-frequency scaling (transformers' `rope_type: llama3`): low frequencies are divided by
    `factor`, high ones kept, the band between interpolated smoothly."""

    __pydantic_config__ = STRICT
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
class LoraConfig:
    """Low-rank adapters (LoRA, as PEFT makes them): every weight of the model is frozen and each targeted
    projection W gets a trained update (alpha / rank) B A, A (rank x in) Kaiming-uniform and B (out x rank) zero at
    the start (PEFT's init), each drawn from (seed, its name)."""

    __pydantic_config__ = STRICT
    rank: Annotated[int, Gt(0), Le(4096), NOT_BOOL] = 8
    """The adapters' rank r."""
    alpha: Annotated[float, Gt(0), Le(1e6), NOT_BOOL] = 8.0
    """The update is scaled by alpha / rank (PEFT's `lora_alpha`; no rsLoRA)."""
    dropout: Annotated[float, Ge(0), Le(0.99), NOT_BOOL] = 0.0
    """Dropout on an adapter's input (PEFT's `lora_dropout`), in training only."""
    targets: Annotated[tuple[Annotated[str, MinLen(1), MaxLen(32)], ...], MinLen(1), MaxLen(16)] = ("q", "v")
    """The projections adapted, by the family's names: llama q, k, v, o, gate, up, down; gpt2 q, k, v, o (its
    attention's output), fc, proj (the MLP's). An MoE block's experts are not adapted (its attention is)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    __pydantic_config__ = STRICT
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
    """Share the token embedding with the output head (nanoGPT style); at pp > 1 the last stage holds a copy kept
    equal to it."""
    moe: MoEConfig | None = None
    """Mixture-of-experts blocks; null for a dense model."""
    family: FamilyName = "gpt2"
    """The model family (`parallel.models`): gpt2 (LayerNorm, GELU, learned positions, biases) or llama
    (RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases), and llama's kin: mistral (an
    optional sliding window), qwen2 (biases on q, k and v), qwen3 (an RMSNorm per head on q and k) and qwen3_moe
    (qwen3's attention, SwiGLU experts); hf: the transformers backend, any `AutoModelForCausalLM` checkpoint no
    native family reads, with transformers' own modules (`init_from.hf` required; data parallelism only;
    `pip install 'trainyard[hf]'`)."""
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
    head_dim: Annotated[int, Gt(0), Le(2**12), NOT_BOOL] | None = None
    """Width of each attention head (llama and its kin; Qwen3's heads are wider than d_model / n_head); null:
    d_model / n_head."""
    sliding_window: Annotated[int, Gt(0), Le(MAX_SEQ_LEN), NOT_BOOL] | None = None
    """mistral: each position attends to itself and the sliding_window - 1 positions before it; null: the
    whole causal context."""
    lora: LoraConfig | None = None
    """Train low-rank adapters on a frozen model instead of every weight; null: full training."""
    hf_config: Annotated[str, MaxLen(1_000_000), CONFIG_JSON] | None = None
    """family hf: the checkpoint's config.json as JSON text (an object with a model_type), which `init_from.hf`
    fills in (the other fields above are read from it too); null for a native family."""

    @property
    def context(self) -> int:
        return self.context_len if self.context_len is not None else self.seq_len

    @property
    def head_size(self) -> int:
        """Width of one attention head: `head_dim`, or d_model / n_head."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_head

    def is_moe_block(self, block: int) -> bool:
        """Whether global block `block` is a mixture-of-experts block: every `moe.every`-th one."""
        return self.moe is not None and (block + 1) % self.moe.every == 0

    @property
    def moe_blocks(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.is_moe_block(i)]

    @property
    def experts(self) -> int:
        """Experts of each mixture-of-experts block; 0 in a dense model."""
        return self.moe.experts if self.moe is not None else 0
