"""The llama family: RMSNorm, rotary positions (Llama 3's rope scaling too), SwiGLU, grouped-query attention,
no biases, optionally tied embeddings; MoE blocks with SwiGLU experts (Mixtral's shape).

Its modules are in `model.py` and `layers.py` (imported when a stage is built), its memory counting in
`counts.py`, its Hugging Face mapping in `hf.py` (`Llama.hf`).

Rules of its own (`check`): n_kv_head divides n_head, tp divides n_kv_head (each tensor-parallel rank keeps
whole kv heads), the head size is even (rotary embeddings turn pairs of dimensions), and `activation`
(gpt2's GELU variant) is refused rather than ignored: llama's MLP is SwiGLU; a sliding window is mistral's.

Llama's kin (mistral, qwen2, qwen3, qwen3_moe) subclass `Llama`: their stage class (`stage_class`), what
they add to the counts, and their HF mapping differ; the rules, the tensor-parallel plan and the rest are
these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from trainyard.parallel.config import JobConfig, ModelConfig, ParallelConfig, RuleError
from trainyard.parallel.models.base import ModelFamily
from trainyard.parallel.models.llama import counts

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle
    from trainyard.parallel.models.components.decoder import DecoderStage


class Llama(ModelFamily):
    name = "llama"
    counts = counts
    lora_targets = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.proj", "gate": "mlp.gate", "up": "mlp.up",
                    "down": "mlp.down"}
    SLIDING_WINDOW = False
    """Whether `model.sliding_window` is honoured (mistral's)."""

    def stage_class(self) -> type[DecoderStage]:
        """The family's `DecoderStage` subclass (imported here: it needs torch)."""
        from trainyard.parallel.models.llama.model import LlamaStage

        return LlamaStage

    def check(self, config: JobConfig, parallel: ParallelConfig) -> list[RuleError]:
        m, tp, errors = config.model, parallel.tp, []
        kv = m.n_kv_head or m.n_head
        if m.n_head % kv:
            errors.append(RuleError("model.n_kv_head", f"n_kv_head={kv} does not divide n_head={m.n_head} (each "
                                                       "key/value head serves n_head / n_kv_head query heads)"))
        elif kv % tp:
            errors.append(RuleError("model.n_kv_head", f"tp={tp} does not divide n_kv_head={kv} (key/value heads "
                                                       "are split across tensor-parallel ranks)"))
        if m.head_dim is not None and m.head_dim % 2:
            errors.append(RuleError("model.head_dim", f"head_dim={m.head_dim} is odd; rotary embeddings need it "
                                                      "even"))
        elif m.head_dim is None and m.d_model % m.n_head == 0 and (m.d_model // m.n_head) % 2:
            errors.append(RuleError("model.n_head", f"the head size d_model / n_head = {m.d_model // m.n_head} is "
                                                    "odd; rotary embeddings need it even"))
        if m.sliding_window is not None and not self.SLIDING_WINDOW:
            errors.append(RuleError("model.sliding_window", f"family {self.name} attends over the whole causal "
                                                            "context; a sliding window is family mistral's"))
        if m.activation != "gelu":
            errors.append(RuleError("model.activation", f"activation={m.activation} is gpt2's; llama's MLP is "
                                                        "SwiGLU (leave activation out)"))
        scaling = m.rope_scaling
        if scaling is not None and scaling.high_freq_factor <= scaling.low_freq_factor:
            errors.append(RuleError("model.rope_scaling.high_freq_factor",
                                    f"high_freq_factor={scaling.high_freq_factor} must exceed "
                                    f"low_freq_factor={scaling.low_freq_factor}"))
        return errors

    def ffn_hidden(self, cfg: ModelConfig) -> int:
        return counts.ffn_hidden(cfg)

    def build_stage(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, seed: int,
                    experts: Iterable[int] | None = None) -> DecoderStage:
        return self.stage_class()(cfg, layers, first=first, last=last, seed=seed, experts=experts)

    def feed_forward(self, cfg: ModelConfig) -> nn.Module:
        from trainyard.parallel.models.llama.layers import SwiGLU

        return SwiGLU(cfg, self.ffn_hidden(cfg))

    def tensor_parallel_plan(self, stage: DecoderStage, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """q column-parallel (n_head / tp heads), k and v column-parallel (n_kv_head / tp heads each), attn.proj
        row-parallel; the MLP's gate and up column-, down row-parallel; RMSNorms sequence-parallel with sp
        (the attention's input is all-gathered before q, k and v, so rotary embeddings see every position);
        embedding and head split over the vocabulary."""
        import trainyard.parallel.models.components.tp_styles as tp

        stream = tp.stream_layout(sequence_parallel)
        layers: dict[str, ParallelStyle] = tp.vocab_embedding("wte", stream) if stage.first else {}
        layers |= tp.blocks(stage, ("gate", "up"), "down", stream, sequence_parallel)
        if stage.last:
            layers |= tp.head(stream, sequence_parallel)
        return layers

    def lora_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int, bool]]:
        d, ffn, q, kv = cfg.d_model, self.ffn_hidden(cfg), counts.q_width(cfg), counts.kv_width(cfg)
        return {"q": (d, q, False), "k": (d, kv, False), "v": (d, kv, False), "o": (q, d, True),
                "gate": (d, ffn, False), "up": (d, ffn, False), "down": (ffn, d, True)}

    def embedding_params(self, cfg: ModelConfig) -> int:
        return cfg.vocab_size * cfg.d_model

