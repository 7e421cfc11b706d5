"""The gpt2 family: LayerNorm, learned positions, GELU MLP (exact or tanh-approximated), biases.

Its modules are in `model.py` and `layers.py` (imported when a stage is built), its memory counting in
`counts.py`, its Hugging Face mapping in `hf.py` (`GPT2.hf`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from trainyard.parallel.config import JobConfig, ModelConfig, ParallelConfig, RuleError
from trainyard.parallel.models.base import ModelFamily
from trainyard.parallel.models.gpt2 import counts

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle
    from trainyard.parallel.models.components.decoder import DecoderStage


class GPT2(ModelFamily):
    name = "gpt2"
    counts = counts
    lora_targets = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.proj", "fc": "mlp.fc", "proj": "mlp.proj"}
    learned_positions = True

    def check(self, config: JobConfig, parallel: ParallelConfig) -> list[RuleError]:
        m, errors = config.model, []
        if m.n_kv_head is not None and m.n_kv_head != m.n_head:
            errors.append(RuleError("model.n_kv_head", f"family gpt2 has no grouped-query attention: n_kv_head "
                                                       f"must be null or n_head={m.n_head} (got {m.n_kv_head})"))
        if m.rope_scaling is not None:
            errors.append(RuleError("model.rope_scaling", "family gpt2 has learned positions, no rotary embedding "
                                                          "to scale (use family: llama)"))
        if m.rope_theta != 10000.0:
            errors.append(RuleError("model.rope_theta", "family gpt2 has learned positions, no rotary embedding "
                                                        "(use family: llama)"))
        if m.head_dim is not None and m.head_dim * m.n_head != m.d_model:
            errors.append(RuleError("model.head_dim", f"family gpt2's heads are d_model / n_head wide; head_dim "
                                                      f"must be null or {m.d_model // m.n_head}"))
        if m.sliding_window is not None:
            errors.append(RuleError("model.sliding_window", "family gpt2 attends over the whole causal context; a "
                                                            "sliding window is family mistral's"))
        return errors

    def ffn_hidden(self, cfg: ModelConfig) -> int:
        return counts.ffn_hidden(cfg)

    def build_stage(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, seed: int,
                    experts: Iterable[int] | None = None) -> DecoderStage:
        from trainyard.parallel.models.gpt2.model import GPTStage

        return GPTStage(cfg, layers, first=first, last=last, seed=seed, experts=experts)

    def feed_forward(self, cfg: ModelConfig) -> nn.Module:
        from trainyard.parallel.models.gpt2.layers import MLP

        return MLP(cfg, self.ffn_hidden(cfg))

    def tensor_parallel_plan(self, stage: DecoderStage, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """q, k and v column-parallel (n_head / tp whole heads each), attn.proj row-parallel; the MLP's fc
        column-, proj row-parallel; LayerNorms sequence-parallel with sp; embedding and head over the
        vocabulary. The learned positions: `wpe` stays replicated; with sp its (seq_len, d_model) output is
        sliced to this rank's positions (a local slice whose backward all-gathers, so every rank gets the
        whole gradient of `wpe` and its weight needs no reduction of ours)."""
        import trainyard.parallel.models.components.tp_styles as tp
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import PrepareModuleOutput

        stream = tp.stream_layout(sequence_parallel)
        layers: dict[str, ParallelStyle] = {}
        if stage.first:
            layers |= tp.vocab_embedding("wte", stream)
            if sequence_parallel:
                layers["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        layers |= tp.blocks(stage, ("fc",), "proj", stream, sequence_parallel)
        if stage.last:
            layers |= tp.head(stream, sequence_parallel)
        return layers

    def lora_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int, bool]]:
        d, ffn = cfg.d_model, self.ffn_hidden(cfg)
        return {"q": (d, d, False), "k": (d, d, False), "v": (d, d, False), "o": (d, d, True), "fc": (d, ffn, False),
                "proj": (ffn, d, True)}

    def embedding_params(self, cfg: ModelConfig) -> int:
        return cfg.vocab_size * cfg.d_model + cfg.context * cfg.d_model

