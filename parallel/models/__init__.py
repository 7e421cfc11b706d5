"""Model families: the registry `FAMILIES` and `family_of(cfg)`, the one way the rest of `parallel/` reaches
a model (see `parallel.models.base` for the interface, docs/design.md, "A model family is one unit").

A family is a folder `parallel/models/<name>/` whose `__init__.py` defines its `ModelFamily`; adding one is
that folder, a line below and its name in `parallel.names.FamilyName` (what `model.family` may say).

Beside the registry and the family folders: the interface (`base`), the vocabulary a family counts its memory in
(`counting`, torch-free: the plan reads it), the whole model of a job (`whole`) and the parts the families share
(`components/`: the decoder stage, MoE, the fused loss, LoRA, tensor-parallel styles, the Hugging Face mapping's
common part...), which import no family.
"""

from __future__ import annotations

from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.base import ModelFamily
from trainyard.parallel.models.gpt2 import GPT2
from trainyard.parallel.models.hf import HFBackend
from trainyard.parallel.models.llama import Llama
from trainyard.parallel.models.mistral import Mistral
from trainyard.parallel.models.qwen2 import Qwen2
from trainyard.parallel.models.qwen3 import Qwen3
from trainyard.parallel.models.qwen3_moe import Qwen3Moe
from trainyard.parallel.names import FAMILY_NAMES, registry

FAMILIES: dict[str, ModelFamily] = registry(FAMILY_NAMES, {family.name: family for family in (
    GPT2(), Llama(), Mistral(), Qwen2(), Qwen3(), Qwen3Moe(),
    HFBackend(),  # last: the transformers backend claims only what no native family reads
)}, "parallel.models.FAMILIES")


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family `cfg.family` names."""
    return FAMILIES[cfg.family]


__all__ = ["FAMILIES", "ModelFamily", "family_of"]
