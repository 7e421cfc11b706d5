"""The qwen3_moe family (Hugging Face `Qwen3MoeForCausalLM`): qwen3's attention (per-head q and k norms,
`head_dim`) with mixture-of-experts blocks of SwiGLU experts (`parallel.models.components.moe`: top-k routing, the
top-k probabilities renormalised or not as `moe.norm_topk_prob` says, the load-balancing loss, expert
parallelism). Modules, tensor-parallel plan and counting are qwen3's (`parallel.models.qwen3`), which are
llama's with the norms; the HF mapping is its own.

Its own rule: a qwen3_moe model has experts (`model.moe`); a dense Qwen3 is family qwen3.
"""

from __future__ import annotations

from trainyard.parallel.config import JobConfig, ParallelConfig, RuleError
from trainyard.parallel.models.qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"

    def check(self, config: JobConfig, parallel: ParallelConfig) -> list[RuleError]:
        errors = super().check(config, parallel)
        if config.model.moe is None:
            errors.append(RuleError("model.moe", "family qwen3_moe has mixture-of-experts blocks: give model.moe "
                                                 "(a dense Qwen3 is family qwen3)"))
        return errors
