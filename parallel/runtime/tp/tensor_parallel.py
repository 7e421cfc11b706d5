"""Tensor and sequence parallelism of a model stage with torch's DTensor.

`apply_tensor_parallel(stage, tp_mesh, sequence_parallel=...)` shards a stage in place over the 1-D
tensor-parallel mesh with `parallelize_module`, by the plan its model family gives
(`ModelFamily.tensor_parallel_plan`, built from `parallel.models.components.tp_styles`; Megatron's layout, as
torchtitan writes it). For gpt2 (llama alike, see its family):
- attention: q, k and v each `ColwiseParallel` (a rank keeps n_head / tp whole heads of each), the output
  projection `RowwiseParallel`; the MLP's `fc` column-parallel, its `proj` row-parallel;
- vocabulary-parallel embedding and head: `wte` `RowwiseParallel` (rows = vocabulary), `lm_head`
  `ColwiseParallel` with its output left a DTensor sharded over the vocabulary, so the cross-entropy runs
  under `loss_parallel()` (see `loss_context`) and the full logits never exist on one rank;
- with sequence parallelism, the LayerNorms (`SequenceParallel`) and the residual stream are sharded along
  the sequence between the tensor-parallel regions: the attention and MLP inputs are all-gathered
  (`PrepareModuleInput`) and their row-parallel outputs reduce-scattered (`output_layouts=Shard(1)`).
  A stage's input and output are then this rank's (micro_batch, seq_len / tp, d_model) slice, which is
  what the pipeline sends (`activation_shape`).

A mixture-of-experts block's feed-forward part is not sharded: its layer takes this rank's slice of every
sequence and returns the same slice (`parallel.models.components.moe` says why and how the routing is shared), so only
its input and output layouts are declared.

The residual stream between the parallel regions is a plain local tensor, as in torchtitan: the styles
hand DTensors only to the layers that need them, so the model's forward stays ordinary torch code.

gpt2's learned position embedding `wpe` (torchtitan's models have none) is the one piece the styles do not
cover directly. Without sequence parallelism it stays a plain replicated module. With it, `wpe` computes
every position on every rank and `PrepareModuleOutput` turns that replicated output into this rank's
sequence slice (a local slice, no communication); the slice's backward is an all-gather, so every rank
gets the whole gradient of `wpe` and its weight needs no reduction of ours. (Looking up only this rank's
positions would save a tiny lookup but leave each rank a partial `wpe` gradient to all-reduce by hand.)

A rank's build (`parallel.runtime.build`) shards a stage built on the meta device (`src_data_rank=None`: nothing
is sent) and only then gives each rank's shards their values (`parallel.runtime.materialize`: each parameter drawn
whole from (seed, name), one at a time, and sliced), so a job at tp=2 starts from exactly the weights of tp=1.

Nothing here is written by hand beyond the choice of styles: DTensor does the collectives in forward and
backward. What it lacks is handled elsewhere, each with its reason:
- `loss_parallel` must also wrap the loss's backward, which the pipeline executor runs later: the
  executor takes `loss_context` and enters it around both.
- DTensor leaves a sequence-parallel norm's gradient a partial sum over tp and computes the vocabulary-
  parallel embedding's gradient whole (it has no row-sharded embedding backward); accumulating into
  gradient buffers with the parameters' placements reduces the one and slices the other
  (`parallel.runtime.dp.data_parallel`).
- The global gradient norm spans DTensor and plain gradients and the pipeline (`parallel.optim.optimizer`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from trainyard.parallel.models import family_of
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.plan import Plan


def apply_tensor_parallel(stage: DecoderStage, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> DecoderStage:
    """Shard `stage`'s parameters over `tp_mesh` and set up the collectives of its forward and backward, by its
    family's plan (`ModelFamily.tensor_parallel_plan`)."""
    plan = family_of(stage.cfg).tensor_parallel_plan(stage, sequence_parallel=sequence_parallel)
    parallelize_module(stage, tp_mesh, plan, src_data_rank=None)
    if stage.last and stage.first and stage.cfg.tie_embeddings:
        # Both are sharded over the vocabulary on dim 0; re-tie the head to the embedding's new DTensor.
        stage.lm_head.weight = stage.wte.weight
    return stage


def activation_shape(plan: Plan) -> tuple[int, int, int]:
    """What one rank sends to the next pipeline stage: its sequence slice with sp, the whole sequence without (with
    context parallelism, of the rank's seq_len / cp tokens)."""
    m = plan.config.model
    tokens = m.seq_len // plan.cp
    seq = tokens // plan.tp if plan.parallel.sp else tokens
    return (plan.micro_batch_size, seq, m.d_model)


def loss_context(plan: Plan) -> Callable[[], contextlib.AbstractContextManager]:
    """The context the last stage's loss and its backward run in: `loss_parallel` when the head is sharded."""
    return loss_parallel if plan.tp > 1 else contextlib.nullcontext
