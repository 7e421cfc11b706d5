"""The transformers backend (`model.family: hf`): any `AutoModelForCausalLM` checkpoint no native family reads,
trained with transformers' own module classes (`model.py`), at data parallelism only. The modules: `build` (the
model from config.json, dropout off), `structure` (what the model is, read on meta), `names` (checkpoint names),
`head` (the model's own logits, and whether the fused loss may compute them), `model` (the stage), `hf` (the
Hugging Face mapping).

Exact or refused: the stage computes what transformers' own forward computes (its body, then its own head, or the
fused loss where the head is proved plain); a model it cannot (tensors converted on load, a head that cannot run
apart from its body, a router loss transformers would add) is a 422 at submit naming why (`structure.refusals`).

What it takes: dp with ZeRO 0-3 (FSDP2 per decoder layer, transformers' `GradientCheckpointingLayer`s), full
activation checkpointing (per decoder layer), bf16, compile, checkpoints and resume at another dp, recovery,
resize, export (`hf.py`: its own names and config.json). What needs a native family, a 422 naming the field: pp, tp
(and so sp), ep (and MoE fields of trainyard's), LoRA, selective recompute. It trains a checkpoint: `init_from.hf`
is required (transformers' own init of a fresh model is not per-shard reproducible as trainyard's is).

Counting: the parameters are exact, from the model built on the meta device (`model.parameter_shapes`); the
activations are Llama's terms at the config's sizes, an estimate (the backend's modules are not trainyard's, and
their saved tensors were not measured).

transformers is an optional extra (`pip install 'trainyard[hf]'`), imported only inside the methods that build or
count the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from trainyard.parallel.config import JobConfig, ModelConfig, ParallelConfig, RuleError
from trainyard.parallel.models.base import Matrix, ModelFamily, ReductionSet
from trainyard.parallel.models.counting import ParamCounts, Shapes
from trainyard.parallel.models.llama import counts as llama_counts

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle
    from trainyard.parallel.models.components.decoder import DecoderStage

NATIVE = "needs a native model family (the transformers backend, model.family hf, trains at data parallelism only)"
LIMITS = "dp with ZeRO 0-3, full recompute, bf16, compile; no pp, tp, sp, ep, LoRA or selective recompute"
"""What `trainyard plan` says of the backend."""


class HFBackend(ModelFamily):
    name = "hf"

    def check(self, config: JobConfig, parallel: ParallelConfig) -> list[RuleError]:
        m, errors = config.model, []
        if m.hf_config is None:
            errors.append(RuleError("model.hf_config", "family hf builds the model from its config.json: give "
                                                       "init_from.hf (which fills it in)"))
        if config.init_from is None:
            errors.append(RuleError("init_from.hf", "family hf trains a transformers checkpoint: give init_from.hf"))
        elif not errors:  # built on meta (cached, no storage): what the ranks will build, checked at submit
            errors += _build_errors(m)
        for field in ("pp", "tp", "ep"):
            if getattr(parallel, field) > 1:
                errors.append(RuleError(f"parallel.{field}", f"{field}={getattr(parallel, field)} {NATIVE}"))
        if parallel.sp:
            errors.append(RuleError("parallel.sp", f"sp {NATIVE}"))
        if m.moe is not None:
            errors.append(RuleError("model.moe", f"trainyard's MoE blocks {NATIVE}"))
        if m.lora is not None:
            errors.append(RuleError("model.lora", f"LoRA {NATIVE}"))
        if config.activation_checkpointing == "selective":
            errors.append(RuleError("activation_checkpointing", f"selective recompute {NATIVE}; full recomputes "
                                                                "each decoder layer"))
        return errors

    def summary(self, cfg: ModelConfig) -> str:
        import json

        architectures = json.loads(cfg.hf_config).get("architectures") if cfg.hf_config else None
        return f"family hf (the transformers backend, {', '.join(architectures or ['?'])}): {LIMITS}"

    def ffn_hidden(self, cfg: ModelConfig) -> int:
        return cfg.ffn_hidden or 4 * cfg.d_model

    def build_stage(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, seed: int,
                    experts: Iterable[int] | None = None) -> DecoderStage:
        from trainyard.parallel.models.hf.model import HFStage

        if not (first and last) or list(layers) != list(range(cfg.n_layer)):
            raise ValueError("the transformers backend builds the whole model as one stage (pp = 1)")
        return HFStage(cfg, seed=seed)  # type: ignore[return-value]  # a DecoderStage in all the trainer asks

    def feed_forward(self, cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError("the transformers backend has no trainyard feed-forward module")

    def tensor_parallel_plan(self, stage: DecoderStage, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        raise NotImplementedError(f"tp {NATIVE}")

    def param_counts(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int,
                     ep: int) -> ParamCounts:
        from trainyard.parallel.models.hf.model import element_counts

        total, embedding, per_layer = element_counts(cfg)
        rest = total - embedding - sum(per_layer)  # the final norm and an untied head
        dense = sum(per_layer[i] for i in layers) + (embedding if first else 0) + (rest if last else 0)
        return ParamCounts(dense, 0, 0)

    def matrices(self, cfg: ModelConfig, layers: Sequence[int], *, first: bool, last: bool, tp: int,
                 ep: int) -> list[Matrix]:
        from trainyard.parallel.models.hf.model import parameter_shapes

        return [(shape[0], shape[1], "dense") for shape in parameter_shapes(cfg).values() if len(shape) == 2]

    def embedding_params(self, cfg: ModelConfig) -> int:
        from trainyard.parallel.models.hf.model import element_counts

        return element_counts(cfg)[1]

    def embed_activations(self, cfg: ModelConfig, s: Shapes) -> int:
        return llama_counts.embed_activations(cfg, s)

    def block_activations(self, cfg: ModelConfig, block: int, s: Shapes) -> tuple[int, int, int]:
        return llama_counts.dense_block(cfg, s)

    def head_activations(self, cfg: ModelConfig, s: Shapes) -> int:
        return llama_counts.head_activations(cfg, s)

    def reduction_set(self, name: str) -> ReductionSet:
        return "dense"  # no trainyard MoE layer: a name with `.moe.experts.` in it is still a dense parameter


def _build_errors(cfg: ModelConfig) -> list[RuleError]:
    """The model cannot be built from its config.json, the backend cannot train it exactly (`structure.refusals`:
    why), or its decoder layers (`structure.decoder_layers`: ZeRO's units) are not config.json's
    num_hidden_layers."""
    from trainyard.parallel.models.hf.structure import structure

    assert cfg.hf_config is not None
    try:
        s = structure(cfg.hf_config)
    except Exception as e:  # noqa: BLE001 - transformers' own error, whatever its type, named for the user
        return [RuleError("init_from.hf", f"transformers cannot build the model from config.json: {e!r}")]
    if s.refusals:
        return [RuleError("init_from.hf", f"the transformers backend cannot train {s.architecture} exactly: "
                                          + "; ".join(s.refusals))]
    if len(s.layers) != cfg.n_layer:
        return [RuleError("init_from.hf", f"found {len(s.layers)} decoder layers (transformers' "
                                          f"GradientCheckpointingLayer modules of its body), config.json says "
                                          f"num_hidden_layers={cfg.n_layer}: the backend shards and recomputes per "
                                          "decoder layer")]
    return []
