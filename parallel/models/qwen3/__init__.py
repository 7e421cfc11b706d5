"""The qwen3 family (Hugging Face `Qwen3ForCausalLM`): llama with an RMSNorm per head on q and on k, applied
before the rotary embedding, and heads `head_dim` wide apart from d_model / n_head.

Everything else is llama's (`parallel.models.llama`), so the family subclasses it. Under tensor parallelism
each rank normalises its own heads with the whole (replicated) norm weights; their gradients are then partial
sums over the tp ranks, so the plan makes the two norms `SequenceParallel` over the heads dimension (dim 2 of
(batch, seq, heads, head_dim)): DTensor then holds the weight replicated and its gradient partial, and the
gradient buffers reduce it as they do a sequence-parallel norm's (`parallel.runtime.tp.tensor_parallel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainyard.parallel.models.counting import ParamCounts, Shapes
from trainyard.parallel.models.llama import Llama
from trainyard.parallel.models.qwen3 import counts

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle
    from trainyard.parallel.config import ModelConfig
    from trainyard.parallel.models.components.decoder import DecoderStage


class Qwen3(Llama):
    name = "qwen3"

    def stage_class(self) -> type[DecoderStage]:
        from trainyard.parallel.models.qwen3.model import Qwen3Stage

        return Qwen3Stage

    def tensor_parallel_plan(self, stage: DecoderStage, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        from torch.distributed.tensor.parallel import SequenceParallel

        layers = super().tensor_parallel_plan(stage, sequence_parallel=sequence_parallel)
        for i in stage.blocks:
            for norm in ("ln_q", "ln_k"):
                layers[f"blocks.{i}.attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        return layers

    def param_counts(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int,
                     ep: int) -> ParamCounts:
        base = super().param_counts(cfg, layers, first=first, last=last, tp=tp, ep=ep)
        return base + ParamCounts(dense=len(layers) * 2 * cfg.head_size, router=0, experts=0)  # replicated

    def block_activations(self, cfg: ModelConfig, block: int, s: Shapes) -> tuple[int, int, int]:
        full, saving, region = super().block_activations(cfg, block, s)
        return full + counts.qk_norms(cfg, s), saving, region
