"""`compile: true`: each transformer block compiled on its own with torch.compile (regional compilation).

As torchtitan's `apply_compile` does, every block of a stage is compiled separately (`nn.Module.compile`,
which compiles the module's call in place, so parameter names, hooks and checkpoints stay as they are),
and the embedding, the head and the loss stay eager. The blocks of a model have one code, so the first
block's compiled graphs serve the others (dynamo treats the parameters of inlined modules as inputs): the
compile time is that of one block, whatever the depth.

What it composes with, each by the ordinary route:
- tensor and sequence parallelism: the blocks hold DTensor parameters and the tp styles' hooks; dynamo
  traces DTensor (torchtitan compiles its blocks after `parallelize_module`, as here);
- recompute: torchtitan applies activation checkpointing first and compiles the checkpointed block, so the
  recomputation is inside the compiled region (the compiler sees what backward recomputes). `full` gives
  each block a forward that runs its old one under torch's non-reentrant `checkpoint` and turns the
  stage's own per-block checkpoint off; `selective` checkpoints inside the attention and MLP modules,
  which dynamo traces as they are;
- bf16: autocast is entered around the stage's forward, outside the blocks, and dynamo honours it;
- pipeline stages: each stage compiles its own blocks; the executor's sends and receives stay eager.

The backend is inductor (`BACKEND`): what the option means on a GPU. It also runs on CPU where a C++
compiler is installed (it generates C++ there). A test may set `BACKEND` to another torch backend (e.g.
`aot_eager`, which traces through dynamo and AOTAutograd but generates no code) to check the composition
without paying for code generation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint
from trainyard.parallel.models.decoder import DecoderStage

BACKEND = "inductor"
"""torch.compile's backend for `compile: true`."""


def compile_blocks(stage: DecoderStage) -> DecoderStage:
    """Compile each of `stage`'s blocks in place (after tensor parallelism and activation checkpointing are
    set up on it); returns the stage."""
    full_recompute = bool(getattr(stage, "recompute_blocks", False))
    for block in stage.blocks.values():
        if full_recompute:  # the checkpoint inside the compiled region, as torchtitan orders them
            block.forward = _checkpointed(block.forward)
        block.compile(backend=BACKEND)
    stage.recompute_blocks = False
    stage.compiled_blocks = True
    return stage


def _checkpointed(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    # A plain function, not functools.partial(checkpoint, ...): dynamo does not trace into a partial of
    # `checkpoint` (which is marked to skip when called from eager), and the block would run uncompiled.
    def forward_recomputed(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(forward, x, use_reentrant=False)

    return forward_recomputed


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's count of its whole compiles, backward
    graphs and code generation included)."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    return float(spent.get("entire_frame_compile", 0.0)) + float(spent.get("entire_backward_compile", 0.0))
