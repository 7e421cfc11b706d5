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
- pipeline stages: each stage compiles its own blocks; the executor's sends and receives stay eager;
- zero-bubble schedules (zb-h1, zbv: a backward split into an input half and a weight half,
  `parallel.runtime.pipeline.split_backward`): see below.

Split backward (`separable_weights=True`). A compiled region is one autograd node (AOTAutograd's
CompiledFunction) whose backward computes every gradient of the region at once: asked for the input's gradient,
it computes the weights' too, and asked again for the weights', the input's again. A block compiled whole would
run its whole backward in each half (measured with aot_eager on a gpt2 block: 12 matmuls in the input half and
12 in the weight half, against eager's 6 and 6). So under a split backward every parameter-holding matmul of a
block stays eager: each `nn.Linear` of the block (attention's q, k, v and output projections, the MLP's, the MoE
router, the experts, LoRA's adapters) runs its forward under `torch.compiler.disable`, and an MoE layer's experts
(`MoELayer._local_experts`, whose grouped matmuls take the experts' weights directly) run eager whole. Dynamo
breaks the block's graph at each of them and compiles what lies between: the norms, rotary embeddings, the
attention core (sdpa), activations, residual adds, the routing. Each linear is then an ordinary autograd node:
the input half computes only its input-gradient matmul and the weight half only its weight-gradient matmul, once
each, as eager does (tests/unit/test_compile_split_backward.py counts them). The parameters left inside compiled
regions are the norms' (their weights, gpt2's LayerNorm biases, qwen3's per-head q and k norms): their region's
node is where their path meets the input's, so its backward runs in both halves, the input half keeping the
input's gradient and the weight half accumulating the norm's (the gradient becomes final there, as eager's):
elementwise work over (tokens x d_model) run twice, small beside a linear's matmul over (tokens x d_model x d_ff).
The cost is fusion: the compiler no longer sees a linear together with what surrounds it (an epilogue such as
a bias add and activation fused into the matmul, or the norm fused into the matmul's prologue), and each graph
break is one more compiled call per block. That is the trade: the zero-bubble schedule's gain (the weight half
filling the pipeline's bubbles) needs each half to do only its own matmuls, which are most of a block's backward,
while what fusion saves is elementwise memory traffic. With `compile: true` and a schedule without a split
backward (1f1b, interleaved-1f1b), blocks are compiled whole as before.

Not with full recompute (`activation_checkpointing: full`, refused by `parallel.plan.rules`): the checkpoint of a
whole block cannot sit inside the compiled region when the block breaks the graph (dynamo skips the whole frame of
a checkpoint whose function breaks it: measured, not one graph compiled, the block eager), nor outside it (torch's
non-reentrant checkpoint around the compiled block: recomputing it in backward saved the tensors in another order,
a CheckpointError, measured on torch 2.13). Selective recompute works: its checkpoints are inside the attention and
the MLP, and one whose function holds a linear runs eager, the rest of the block compiled.
(A process compiles its blocks one way:
dynamo's guards on a block's code do not tell the two apart, and a block compiled whole after one with eager
linears reuses the latter's graphs, the same numbers with less fusion. A rank builds one plan's blocks.)

The backend is inductor (`BACKEND`): what the option means on a GPU. It also runs on CPU where a C++
compiler is installed (it generates C++ there). A test may set `BACKEND` to another torch backend (e.g.
`aot_eager`, which traces through dynamo and AOTAutograd but generates no code) to check the composition
without paying for code generation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.models.components.moe import MoELayer

BACKEND = "inductor"
"""torch.compile's backend for `compile: true`."""


def compile_blocks(stage: DecoderStage, *, separable_weights: bool = False) -> DecoderStage:
    """Compile each of `stage`'s blocks in place (after tensor parallelism, LoRA and activation checkpointing are
    set up on it); returns the stage. `separable_weights`: the schedule splits each backward in two (zb-h1, zbv),
    so every parameter-holding matmul stays eager, outside the compiled regions (`keep_matmuls_eager`)."""
    full_recompute = bool(getattr(stage, "recompute_blocks", False))
    if separable_weights and full_recompute:
        raise ValueError("full recompute with eager linears compiles nothing (`parallel.plan.rules` refuses it)")
    for block in stage.blocks.values():
        if separable_weights:
            keep_matmuls_eager(block)
        if full_recompute:  # the checkpoint inside the compiled region, as torchtitan orders them
            block.forward = _checkpointed(block.forward)
        block.compile(backend=BACKEND)
    stage.recompute_blocks = False
    stage.compiled_blocks = True
    return stage


def keep_matmuls_eager(block: nn.Module) -> None:
    """Make every matmul with a parameter in `block` run eager when the block is compiled: each `nn.Linear`'s
    forward (its hooks, tp's and LoRA's, stay where they are) and each MoE layer's experts. Refuses a block with a
    matrix parameter (2-D or more) that neither covers: it would stay inside a compiled region, whose backward
    computes the input's and the weights' gradients together (see the module's docstring)."""
    eager: set[int] = set()
    for module in block.modules():
        if isinstance(module, nn.Linear):
            module.forward = torch.compiler.disable(module.forward)  # type: ignore[method-assign]
            eager.update(id(p) for p in module.parameters())
        elif isinstance(module, MoELayer):  # the grouped path multiplies by the experts' weights directly
            module._local_experts = torch.compiler.disable(module._local_experts)  # type: ignore[method-assign]
            eager.update(id(p) for p in module.experts.parameters())
    inside = [name for name, p in block.named_parameters() if p.dim() >= 2 and id(p) not in eager]
    if inside:
        raise ValueError(f"{type(block).__name__}: {inside} would be multiplied inside a compiled region, whose "
                         "backward computes input and weight gradients together: a split backward (zb-h1, zbv) "
                         "would run it in both halves")


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
