"""The model-family interface: everything the rest of `parallel/` may ask of a model.

A family (torchtitan's TrainSpec / ModelSpec) is one object registered in `parallel.models.FAMILIES`. The
trainer, the plan, the memory plan and tensor parallelism ask it; they never name a module of one:

- rules: `check(config, parallel)` returns the family's own RuleErrors (the plan raises the first; the API: 422);
- modules: `build_stage(cfg, layers, first=, last=, seed=, experts=)` builds one pipeline stage (see
  `parallel.models.components.decoder.DecoderStage` for what a stage offers), `feed_forward(cfg)` its dense feed-forward
  module (one MoE expert is the stage class's `expert(cfg)`, by default the same module;
  `parallel.models.components.moe` is handed it);
- tensor parallelism: `tensor_parallel_plan(stage, sequence_parallel=)` returns the `parallelize_module`
  plan (which projections are column- or row-parallel, which norms sequence-parallel);
- counting (pure arithmetic, for `parallel.plan.memory.estimate` and MFU): `param_counts`, `embed_activations`,
  `block_activations`, `head_activations`, `flops_per_token`; `ffn_hidden(cfg)` the feed-forward width;
- LoRA: `lora_targets` names the projections `model.lora.targets` may adapt (`parallel.models.components.lora`);
- gradients: `reduction_set(name)` says which group sums a parameter's gradient (dense, router, experts);
- Hugging Face: `hf` is the family's `parallel/models/<family>/hf.py` module, imported on first use.

A family object imports torch only inside the methods that build modules, so `parallel.plan` and
`parallel.plan.memory.estimate` stay free of torch.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Literal

from trainyard.parallel.config import JobConfig, ModelConfig, ParallelConfig, RuleError
from trainyard.parallel.models.counting import ParamCounts, Shapes

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle
    from trainyard.parallel.models.components.decoder import DecoderStage

ReductionSet = Literal["dense", "router", "experts"]
Matrix = tuple[int, int, ReductionSet]
"""(rows, cols, reduction set) of a 2-D parameter's local shard."""


class ModelFamily(ABC):
    name: str
    """The value of `model.family` that selects this family (also its folder under `parallel/models/`)."""
    lora_targets: dict[str, str] = {}
    """`model.lora.targets`' names -> the projection's module path inside a block
    (`parallel.models.components.lora`)."""
    learned_positions: bool = False
    """Its positions are a learned embedding table (gpt2's), which sequence parallelism slices as one (seq_len,
    d_model) table: packed examples, whose positions restart at each, cannot run with `parallel.sp`
    (`parallel.plan.rules.packing_violations`)."""

    def summary(self, cfg: ModelConfig) -> str:
        """What `trainyard plan` says of the model: the family, and what it cannot do (a native family: nothing)."""
        return f"family {self.name}"

    @property
    def hf(self) -> ModuleType:
        """The family's Hugging Face mapping, `parallel/models/<name>/hf.py`, imported on first use."""
        return importlib.import_module(f"trainyard.parallel.models.{self.name}.hf")

    @abstractmethod
    def check(self, config: JobConfig, parallel: ParallelConfig) -> list[RuleError]:
        """The family's own rules on a job (fields it cannot honour, divisibility its layers need); `parallel` is the
        job's layout, written out (`config.parallel` once the planner resolved an `auto`)."""

    @abstractmethod
    def ffn_hidden(self, cfg: ModelConfig) -> int:
        """Width of the feed-forward hidden layer (and of each expert's)."""

    @abstractmethod
    def build_stage(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, seed: int,
                    experts: Iterable[int] | None = None) -> DecoderStage:
        """The blocks `layers` (global indices), the embedding if `first`, the final norm and head if `last`,
        initialised from (seed, parameter name); `experts`: the experts its MoE blocks host (default all)."""

    @abstractmethod
    def feed_forward(self, cfg: ModelConfig) -> nn.Module:
        """A dense block's feed-forward module."""

    @abstractmethod
    def tensor_parallel_plan(self, stage: DecoderStage, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """`parallelize_module`'s plan for one stage: module path -> style."""

    counts: ModuleType | None = None
    """The family's counting module (`parallel/models/<family>/counts.py`: `param_counts`, `matrices`,
    `embed_activations`, `block_activations`, `head_activations`, each with the method's arguments); the five
    methods below ask it. A family without one overrides them."""

    def _counts(self) -> ModuleType:
        if self.counts is None:
            raise NotImplementedError(f"family {self.name} has no counts module and does not count itself")
        return self.counts

    def param_counts(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int,
                     ep: int) -> ParamCounts:
        """Exact local parameter elements of one stage at tensor-parallel degree tp (tied embeddings once)."""
        counted: ParamCounts = self._counts().param_counts(cfg, layers, first=first, last=last, tp=tp, ep=ep)
        return counted

    def embed_activations(self, cfg: ModelConfig, s: Shapes) -> int:
        """Bytes the first stage's embedding keeps for backward, per micro-batch."""
        return int(self._counts().embed_activations(cfg, s))

    def block_activations(self, cfg: ModelConfig, block: int, s: Shapes) -> tuple[int, int, int]:
        """Block `block` per micro-batch: (bytes kept with no checkpointing, bytes selective checkpointing
        saves, bytes of the region selective checkpointing recomputes at once)."""
        kept, saved, region = self._counts().block_activations(cfg, block, s)
        return kept, saved, region

    def head_activations(self, cfg: ModelConfig, s: Shapes) -> int:
        """Bytes the final norm, the head and the loss keep, per micro-batch."""
        return int(self._counts().head_activations(cfg, s))

    def matrices(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int,
                 ep: int) -> list[Matrix]:
        """The local shape of every 2-D parameter of one stage at tensor-parallel degree tp, with its reduction
        set (what gradient compression works on; the rest of `param_counts` is 1-D)."""
        return list(self._counts().matrices(cfg, layers, first=first, last=last, tp=tp, ep=ep))

    @abstractmethod
    def embedding_params(self, cfg: ModelConfig) -> int:
        """Parameters of the lookups (no matmul): the token embedding, and learned positions if any."""

    def flops_per_token(self, cfg: ModelConfig) -> float:
        """Training FLOPs per token: 6 N + 12 L d T (PaLM's appendix B), N the parameters a token meets in
        matmuls (all but the embedding lookups; of an MoE block's experts only top_k)."""
        counts = self.param_counts(cfg, range(cfg.n_layer), first=True, last=True, tp=1, ep=1)
        active: float = counts.dense + counts.router - self.embedding_params(cfg)
        if cfg.moe is not None:
            active += counts.experts * cfg.moe.top_k / cfg.moe.experts
        return 6 * active + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len

    def lora_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int, bool]]:
        """Each of `lora_targets`' projections: (in features, out features, row-parallel under tp)."""
        return {}

    def adapter_elements(self, cfg: ModelConfig, layers: Sequence[int], *, tp: int) -> int:
        """Local elements of the LoRA adapters of blocks `layers` at tensor-parallel degree tp
        (`parallel.models.components.lora`: A (rank x in) and B (out x rank), the one split over tp that the base
        splits; an MoE block's feed-forward has none)."""
        if cfg.lora is None:
            return 0
        shapes, r, total = self.lora_shapes(cfg), cfg.lora.rank, 0
        for block in layers:
            for target in cfg.lora.targets:
                if cfg.is_moe_block(block) and self.lora_targets[target].startswith("mlp."):
                    continue
                n_in, n_out, rowwise = shapes[target]
                total += r * n_in // tp + r * n_out if rowwise else r * n_in + r * n_out // tp
        return total

    def reduction_set(self, name: str) -> ReductionSet:
        """Which ranks sum a parameter's gradient (see `parallel.models.components.moe`): dense parameters over dp, an
        MoE router over its whole stage, experts over the ranks holding the same experts."""
        if ".moe.router." in name:
            return "router"
        if ".moe.experts." in name:
            return "experts"
        return "dense"
