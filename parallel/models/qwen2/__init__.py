"""The qwen2 family (Hugging Face `Qwen2ForCausalLM`, Qwen2 and Qwen2.5): llama with biases on q, k and v.

Everything but those biases is llama's (`parallel.models.llama`: rules, tensor-parallel plan, counting), so the
family subclasses it; the biases are column-parallel with their projections (each tp rank keeps its heads'
entries). The small published sizes tie their embeddings (`tie_word_embeddings`), at pp=1 as any family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainyard.parallel.models.counting import ParamCounts
from trainyard.parallel.models.llama import Llama
from trainyard.parallel.models.llama.counts import kv_width, q_width

if TYPE_CHECKING:
    from trainyard.parallel.config import ModelConfig
    from trainyard.parallel.models.components.decoder import DecoderStage


class Qwen2(Llama):
    name = "qwen2"

    def stage_class(self) -> type[DecoderStage]:
        from trainyard.parallel.models.qwen2.model import Qwen2Stage

        return Qwen2Stage

    def param_counts(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int,
                     ep: int) -> ParamCounts:
        counts = super().param_counts(cfg, layers, first=first, last=last, tp=tp, ep=ep)
        biases = len(layers) * (q_width(cfg) + 2 * kv_width(cfg)) // tp  # split over tp as their weights' rows
        return counts + ParamCounts(dense=biases, router=0, experts=0)
