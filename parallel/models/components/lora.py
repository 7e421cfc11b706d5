"""LoRA (`model.lora`): low-rank adapters on a built stage's projections, every other weight frozen.

`apply_lora(stage, lora, seed=, tp_plan=, tp_mesh=)` freezes every parameter of the stage (`requires_grad`
False: no gradient, no optimizer state, nothing to reduce) and gives each targeted `nn.Linear` W (the family's
`lora_targets`) two children, `lora_A` (rank x in) and `lora_B` (out x rank), and a forward hook adding
(alpha / rank) B A dropout(x) to W's output, as PEFT's `LoraLayer` does. The base weight keeps its name
(`blocks.0.attn.q.weight`), so the Hugging Face mapping and the checkpoints of the base stay valid; the
adapters are `blocks.0.attn.q.lora_A.weight` and `.lora_B.weight`, trainable, and the only parameters a
checkpoint of a LoRA job holds (the base comes back from `init_from` or the seed).

Init is PEFT's (A Kaiming-uniform with a = sqrt(5), B zero, so the adapted model starts equal to the base), A
drawn from (seed, its name) as every parameter is, so every layout starts from the same adapters.

Applied after tensor parallelism (`parallel.runtime.tp.tensor_parallel`), whose styles shard the base's own
parameters only, and split to match the base (Megatron's LoRA layout):
- a column-parallel base (output features sharded): A replicated, B column-parallel (`Shard(0)`); the hook
  sees the style's replicated input, and B's output is the same column shard as the base's;
- a row-parallel base (input features sharded): A row-parallel (`Shard(1)`), B replicated; A's output is a
  partial sum over tp, all-reduced at rank width (cheaper than the output's), then B's output is brought to the
  style's output layout (the residual stream: replicated, or a sequence shard with sp).
DTensor does the collectives and their backward (A's gradient under a column-parallel base is a partial sum,
which the reducers and FSDP2 bring to A's replicated placement).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from trainyard.parallel.config import LoraConfig, ModelConfig
from trainyard.parallel.models import family_of
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.seeds import derive_seed

ADAPTERS = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter (not a base weight)."""
    return any(f".{a}." in name for a in ADAPTERS)


def target_paths(cfg: ModelConfig, blocks: nn.ModuleDict) -> Iterator[tuple[str, nn.Linear]]:
    """(path in the stage, module) of each projection `cfg.lora.targets` names, block by block. An MoE block has no
    `mlp`: its experts are not adapted."""
    assert cfg.lora is not None
    paths = family_of(cfg).lora_targets
    for i, block in blocks.items():
        for target in cfg.lora.targets:
            try:
                module = block.get_submodule(paths[target])
            except AttributeError:  # an MoE block's feed-forward
                continue
            assert isinstance(module, nn.Linear)
            yield f"blocks.{i}.{paths[target]}", module


def adapter_names(cfg: ModelConfig) -> list[str]:
    """Every adapter parameter of the whole model `cfg` describes (no module is built)."""
    assert cfg.lora is not None
    paths = family_of(cfg).lora_targets
    return [f"blocks.{i}.{paths[t]}.{a}.weight" for i in range(cfg.n_layer) for t in cfg.lora.targets for a in ADAPTERS
            if not (cfg.is_moe_block(i) and paths[t].startswith("mlp."))]


def init_adapter(seed: int, name: str, shape: tuple[int, int]) -> torch.Tensor:
    """An adapter's initial value: PEFT's `reset_lora_parameters` (A Kaiming-uniform a = sqrt(5), B zero), A drawn
    from (seed, name)."""
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape)
    weight = torch.empty(shape)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=torch.Generator().manual_seed(derive_seed(
        seed, "param", name)))
    return weight


class _AddAdapter:
    """The forward hook of an adapted projection: its output plus (alpha / rank) B A dropout(x)."""

    def __init__(self, scaling: float, rowwise: bool, out_layout: Placement | None, local_output: bool):
        self.scaling, self.rowwise, self.out_layout, self.local_output = scaling, rowwise, out_layout, local_output

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        adapter_a, adapter_b, dropout = (module.get_submodule(n) for n in (*ADAPTERS, "lora_dropout"))
        h = adapter_a(dropout(args[0]))
        if self.rowwise:  # a partial sum over tp (A is row-parallel): summed at rank width
            h = h.redistribute(placements=[Replicate()])
        y = adapter_b(h) * self.scaling
        if isinstance(y, DTensor):
            assert self.out_layout is not None
            y = y.redistribute(placements=[self.out_layout])
            if self.local_output:
                y = y.to_local()
        return out + y


def apply_lora(stage: DecoderStage, *, seed: int, tp_mesh: DeviceMesh | None = None,
               sequence_parallel: bool = False) -> DecoderStage:
    """Freeze `stage` and adapt its targeted projections (see the module docstring); `tp_mesh`: the mesh the stage
    was sharded over (its family's plan, the same again, says how to split each adapter)."""
    lora = stage.cfg.lora
    assert lora is not None
    tp_plan: Mapping[str, ParallelStyle] | None = None
    if tp_mesh is not None:
        tp_plan = family_of(stage.cfg).tensor_parallel_plan(stage, sequence_parallel=sequence_parallel)
    for p in stage.parameters():
        p.requires_grad_(False)
    scaling = lora.alpha / lora.rank
    for path, linear in target_paths(stage.cfg, stage.blocks):
        out_features, in_features = linear.weight.shape  # a DTensor's shape is the whole tensor's
        device = (linear.weight.to_local() if isinstance(linear.weight, DTensor) else linear.weight).device
        style = tp_plan.get(path) if tp_plan is not None else None
        rowwise = isinstance(style, RowwiseParallel)
        layouts = {"lora_A": [Shard(1) if rowwise else Replicate()], "lora_B": [Replicate() if rowwise else Shard(0)]}
        for adapter, shape in (("lora_A", (lora.rank, in_features)), ("lora_B", (out_features, lora.rank))):
            value = init_adapter(seed, f"{path}.{adapter}.weight", shape).to(device)
            if style is not None:
                assert tp_mesh is not None
                value = distribute_tensor(value, tp_mesh, layouts[adapter], src_data_rank=None)
            child = nn.Linear(shape[1], shape[0], bias=False, device="meta")  # no init: the value is set below
            child.weight = nn.Parameter(value)
            linear.add_module(adapter, child)
        linear.add_module("lora_dropout", nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity())
        out_layout, local_output = None, True
        if isinstance(style, ColwiseParallel | RowwiseParallel):
            out_layout, local_output = style.output_layouts[0], style.use_local_output
        linear.register_forward_hook(_AddAdapter(scaling, rowwise, out_layout, local_output))
    return stage


def merged(state: Mapping[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """A whole model's state (an export's) with each adapter folded into its base weight, W + (alpha / rank) B A,
    and the adapters dropped: the plain model the adapted one computes."""
    out = {name: t for name, t in state.items() if not is_adapter(name)}
    scaling = lora.alpha / lora.rank
    for name, a in state.items():
        if name.endswith(".lora_A.weight"):
            base = name.removesuffix(".lora_A.weight")
            b = state[f"{base}.lora_B.weight"]
            out[f"{base}.weight"] = (out[f"{base}.weight"].double() + scaling * (b.double() @ a.double())).to(
                out[f"{base}.weight"].dtype)
    return out
