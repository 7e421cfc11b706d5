"""A chunk's backward in two halves (zero-bubble schedules): the input gradient now, the weights' later.

`backward_input` is torch's own `stage_backward_input` (torch.distributed.pipelining): it computes the
gradient of the chunk's input with `torch.autograd.grad`, keeping the graph, and records, for each group of
parameters, the gradients that reached the graph nodes where the input's path meets them ("intermediates").
`backward_weight` then runs autograd from those nodes to the parameters only, so nothing of the input's path
is computed twice.

The weight half is written by hand (torch's `stage_backward_weight` is the same walk) for one reason: torch's
calls `torch.autograd.grad` and adds the result to `.grad` itself, so the parameters' AccumulateGrad nodes
never run and their post-accumulate hooks never fire; the gradient reducer (`parallel.runtime.dp.data_parallel`) starts
a bucket's reduction from those hooks, and keeps `.grad` as a view into its bucket that autograd must add to
in place. Here `torch.autograd.backward(edges, inputs=params)` accumulates exactly as a whole backward does.

A chunk whose input needs no gradient (virtual stage 0, which embeds tokens) has no input path to split
off: its input half does nothing and its weight half is the whole backward, as torch does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge

# torch.distributed.pipelining is imported by the two functions that use it: importing it pulls in torch._dynamo
# (about a fifth of a rank's start-up imports), which a rank that never splits a backward does not need.

ParamGroups = list[dict[str, Any]]


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor,
                   params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, ParamGroups]:
    """The gradient of `x` (also left in `x.grad`) for `out`'s gradient `grad` (None: `out` is the loss), and
    what `backward_weight` needs to finish the backward later."""
    if out._is_view():  # torch detaches the output in place to free its graph, which a view cannot be
        out = out.clone()
    from torch.distributed.pipelining._backward import stage_backward_input

    (dx,), groups = stage_backward_input([out], None if grad is None else [grad], [x], iter(params))
    assert dx is not None  # x requires grad (a received activation) and `out` was computed from it
    return dx, groups


def backward_weight(groups: ParamGroups, params: list[torch.nn.Parameter], one_call: bool = False) -> None:
    """Accumulate the parameters' gradients into `.grad` (hooks firing) from what `backward_input` kept.

    By default one backward per group of parameters (torch's way). `one_call`: one backward over every group's
    edges, for a chunk that recomputes its blocks (full activation checkpointing), where each backward call
    recomputes the checkpointed forward: a call per group recomputed a block once per group (measured on one
    llama block: 61 matmuls in the weight half against 7 without recompute; in one call, 20). Without recompute
    one call costs more (14 against 7): a later layer's node then also computes its input gradient, which an
    earlier intermediate's captured gradient replaces."""
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    param_of = {_get_grad_fn_or_grad_acc(p): p for p in params}
    calls = [groups] if one_call else [[group] for group in groups]
    for call in calls:
        edges, grads, inputs, seen = [], [], [], []
        for group in call:
            nodes = group.pop("intermediates")
            captured = group.pop("grads", None) or [None] * len(nodes)
            for node_grads, node in zip(captured, nodes, strict=True):
                seen.append((node, node_grads))
                for i, g in enumerate(node_grads or ()):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            inputs += [param_of[n] for n in group["params"]]
        # Where one intermediate feeds another, autograd would add the first's gradient into the second's
        # again: each node is made to see exactly what it saw in the input half (torch does the same).
        handles = [node.register_prehook(lambda _, seen=tuple(node_grads): seen)
                   for node, node_grads in seen if node_grads is not None] if len(seen) > 1 else []
        try:
            if edges:
                torch.autograd.backward(edges, grads, inputs=inputs)
        finally:
            for handle in handles:
                handle.remove()
