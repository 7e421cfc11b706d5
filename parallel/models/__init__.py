"""Model families: the registry `FAMILIES` and `family_of(cfg)`, the one way the rest of `parallel/` reaches
a model (see `parallel.models.base` for the interface, docs/design.md, "A model family is one unit").

A family is a folder `parallel/models/<name>/` whose `__init__.py` defines its `ModelFamily`; adding one is
that folder, a line below and its name in `ModelConfig.family`.
"""

from __future__ import annotations

from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.base import ModelFamily
from trainyard.parallel.models.gpt2 import GPT2
from trainyard.parallel.models.llama import Llama
from trainyard.parallel.models.mistral import Mistral
from trainyard.parallel.models.qwen2 import Qwen2
from trainyard.parallel.models.qwen3 import Qwen3
from trainyard.parallel.models.qwen3_moe import Qwen3Moe

FAMILIES: dict[str, ModelFamily] = {
    "gpt2": GPT2(),
    "llama": Llama(),
    "mistral": Mistral(),
    "qwen2": Qwen2(),
    "qwen3": Qwen3(),
    "qwen3_moe": Qwen3Moe(),
}


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family `cfg.family` names."""
    return FAMILIES[cfg.family]


__all__ = ["FAMILIES", "ModelFamily", "family_of"]
