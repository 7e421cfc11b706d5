"""Construction on the meta device: a rank's chunks get storage for their own shards only, and their values.

A rank's build (`parallel.runtime.build`, which gives the order of its steps) makes every chunk under
`torch.device("meta")` (shapes, no storage), applies tensor parallelism, expert parallelism (a rank builds only the
experts it hosts) and FSDP2 there, and only then calls `materialize`: `to_empty` gives each parameter storage for
this rank's part on the rank's device (FSDP2's own `_apply` pads its uneven shards and re-points them), every
parameter is filled with exactly the values the whole tensor would hold (`fill_local`), and the buffers are
recomputed from the config (`DecoderStage.reset_buffers`; `to_empty` leaves them uninitialised). So no rank ever
holds more than its own shards plus one whole parameter at a time, the transient the memory plan counts
(`parallel.plan.memory.estimate`: `construction`).

Why one whole parameter at a time and keep the slice, rather than a generator that draws only this rank's
elements (torch's DTensor random ops, offset-based Philox): the values are then bitwise those of the whole
construction (`parallel.models.components.decoder.init_parameters`) at every layout, whatever tp, ep, ZeRO or pipeline
split, and a job resharded or resumed at another layout starts from the same weights: one (seed, name) generator, one
stream. A sharding-aware generator's values depend on how it is sharded (DTensor's offset rule is its own and
differs from a CPU generator's stream), and would give each layout other weights. The cost is time (each rank
draws every parameter of its chunks whole) and one parameter's transient, not memory per rank.

Which slice a rank holds: torch's own `compute_local_shape_and_global_offset` through `parallel.io.hf_checkpoint`'s
`local_block` (the same block `init_from` reads), which follows DTensor's placements: tensor parallelism's
`Shard`, FSDP2's `Shard(0)` with torch.chunk's uneven sizes (a last rank may hold fewer rows, or none: FSDP2
keeps its padding out of the DTensor's local tensor), and FSDP2's `_StridedShard` where tp and dp split the same
dimension.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from trainyard.parallel.io.hf_checkpoint import local_block
from trainyard.parallel.models.components.decoder import DecoderStage, initial_value
from trainyard.parallel.models.components.lora import init_adapter, is_adapter
from trainyard.parallel.runtime.tp.local_parts import local_part


def local_slices(p: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the whole tensor that parameter `p` holds on this rank (everything unless a DTensor)."""
    return tuple(slice(start, stop) for start, stop in local_block(p))


@torch.no_grad()
def fill_local(p: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's slice of `whole` (the tensor `p` stands for) into `p`'s local storage."""
    local = local_part(p)
    part = whole[local_slices(p)]
    if part.shape != local.shape:  # a placement the block does not describe: say so rather than fill wrongly
        raise ValueError(f"a {type(p).__name__} of shape {tuple(p.shape)} holds a local {tuple(local.shape)}, but "
                         f"its block {local_block(p)} has shape {tuple(part.shape)}")
    local.copy_(part)


@torch.no_grad()
def materialize(chunks: Sequence[DecoderStage], device: torch.device, *, seed: int, fill: bool = True) -> None:
    """Give meta-built (and sharded) `chunks` storage on `device` for this rank's parts, fill every parameter from
    its (seed, name) initial value (unless `fill` is False: `init_from` overwrites every one of them), and
    recompute their buffers. LoRA's adapters are always filled (PEFT's init; an `init_from.adapter` is read after).
    Tied embeddings stay one parameter (`to_empty` keeps each Parameter object)."""
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    # Swapped in place, each Parameter object stays itself: without it `to_empty` gives a meta parameter a new
    # Parameter in each module holding it, and tied embeddings would become two tensors.
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for chunk in chunks:
            chunk.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    for chunk in chunks:
        n_layer, residual, aliases = chunk.cfg.n_layer, type(chunk).RESIDUAL, chunk.init_aliases
        for name, p in chunk.named_parameters():  # a tied parameter once, by its first name (as whole)
            if is_adapter(name):  # LoRA's adapters start from PEFT's init whatever the base starts from
                fill_local(p, init_adapter(seed, name, (p.shape[0], p.shape[1])))
            elif fill:
                fill_local(p, initial_value(aliases.get(name, name), p.shape, seed=seed, n_layer=n_layer,
                                            residual=residual))
        chunk.reset_buffers()

