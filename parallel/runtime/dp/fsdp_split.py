"""ZeRO-2/3 (FSDP2, `parallel.runtime.dp.fsdp`) under the zero-bubble schedules, whose backward is split in two
(`parallel.runtime.pipeline.split_backward`): the input half computes the input's gradient, the weight half the
parameters'. A unit's gradient becomes final in the weight half, so it is reduce-scattered after that half, and the unit
is gathered for both halves.

Both halves name the parameters they stop at (the input half) or walk to (the weight half), and a freed unit's
parameters are its shards, which the graph does not hold: so the chunk's units are gathered before either half
(`gather_split`), and the parameters are then the gathered tensors the graph saved (FSDP2 refills the same
storages at every gather). In the input half FSDP2's own hooks run each unit's post-backward, which reduce-scatters
nothing (no AccumulateGrad node runs: no parameter has a gradient yet) and frees the unit at ZeRO-3 as after any
backward. The weight half passes none of FSDP2's hooks: afterwards `reduce_after_weight` runs what FSDP2's
end-of-backward callback runs (`_root_post_backward_final_callback`: each unit's post-backward, which now finds the
gradients, reduce-scatters them into the shards and frees the unit as the flags say; at the chunk's last backward
also `finalize_backward`). torch's pipelining does the same for its zero-bubble schedules
(`torch/distributed/pipelining/stage.py`, `perform_reduce_grad`) once per stage at the step's end; here after each
weight half, so gradients stay sharded between micro-batches as under the other schedules.

A chunk's units are all gathered for each half (each is one autograd call over the chunk's parameters): under a zb
schedule a rank's peak of gathered parameters is a chunk, not two blocks (`parallel.plan.memory.estimate` counts it). At
virtual stage 0 nothing here runs: its input half computes nothing and its weight half is a whole backward.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule, fully_shard


def gather_split(units: list[FSDPModule]) -> None:
    """Before either half of a split backward of a chunk whose units (and routers and experts) are `units`: every
    one whole."""
    for unit in dict.fromkeys(units):
        unit.unshard()


def reduce_after_weight(tops: list[FSDPModule]) -> None:
    """After the weight half of the chunk whose roots are `tops`: each unit's post-backward (reduce-scatter, free as
    the flags say), as FSDP2's end-of-backward callback runs it. contract() sets `.state` on fully_shard at run
    time."""
    for top in tops:
        fully_shard.state(top)._root_post_backward_final_callback()  # type: ignore[attr-defined]
