"""The pieces of a family's tensor-parallel plan (Megatron's layout, as torchtitan writes it with DTensor).

A family's `tensor_parallel_plan` assembles these per stage; `parallel.runtime.tp.tensor_parallel` applies the plan
and says why the layout is what it is. `stream` is the residual stream's layout between the parallel
regions: `Shard(1)` (the sequence) with sequence parallelism, else `Replicate()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

if TYPE_CHECKING:
    from trainyard.parallel.models.components.decoder import DecoderStage


def stream_layout(sequence_parallel: bool) -> Placement:
    return Shard(1) if sequence_parallel else Replicate()


def vocab_embedding(name: str, stream: Placement) -> dict[str, ParallelStyle]:
    """The token embedding split over the vocabulary (rows); its output lands in the stream's layout."""
    return {name: RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)}


def region(prefix: str, norm: str, columns: Sequence[str], row: str, stream: Placement,
           sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A norm, then a region whose `columns` are column-parallel and whose `row` is row-parallel."""
    layers: dict[str, ParallelStyle] = {}
    block, _, module = prefix.rpartition(".")
    if sequence_parallel:
        layers[f"{block}.{norm}"] = SequenceParallel()
    # One DTensor input shared by the region's column-parallel layers: their input gradients add up as
    # partial sums and are reduced once (all-reduce, or reduce-scatter with sp), not once per layer.
    layers[prefix] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
    for name in columns:
        layers[f"{prefix}.{name}"] = ColwiseParallel()
    layers[f"{prefix}.{row}"] = RowwiseParallel(output_layouts=stream)
    return layers


def moe_region(block: str, stream: Placement, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The MoE layer is plain torch code on this rank's slice of each sequence (see parallel.models.components.moe):
    hand it the slice, and give the stream back its layout (without sp: an all-gather, whose backward slices)."""
    layers: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        layers[f"{block}.ln_2"] = SequenceParallel()
    layers[f"{block}.moe"] = PrepareModuleInputOutput(
        input_layouts=(stream,), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(stream,), use_local_output=True)
    return layers


def blocks(stage: DecoderStage, mlp_columns: Sequence[str], mlp_row: str, stream: Placement,
           sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Each block of a stage: its attention (q, k, v column-parallel, proj row-parallel), then its MoE layer or its
    MLP (`mlp_columns` column-parallel, `mlp_row` row-parallel)."""
    layers: dict[str, ParallelStyle] = {}
    for i in stage.blocks:
        block = f"blocks.{i}"
        moe = stage.cfg.is_moe_block(int(i))
        if moe:
            layers |= moe_region(block, stream, sequence_parallel)
        layers |= region(f"{block}.attn", "ln_1", ("q", "k", "v"), "proj", stream, sequence_parallel)
        if not moe:
            layers |= region(f"{block}.mlp", "ln_2", mlp_columns, mlp_row, stream, sequence_parallel)
    return layers


def head(stream: Placement, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """ln_f (sequence-parallel with sp) and the head, its logits left sharded over the vocabulary (for
    `loss_parallel`)."""
    layers: dict[str, ParallelStyle] = {"ln_f": SequenceParallel()} if sequence_parallel else {}
    layers["lm_head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    return layers
