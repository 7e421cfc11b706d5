"""How a rank is built: its model chunks, their sharding and values, their gradient reducers and its optimizer, in
one fixed order of named steps (as torchtitan's `parallelize` per model family).

`build_rank(plan, rank, groups, device)` runs the steps below and returns a `BuiltRank`, which `RankTrainer` takes
as is. Each chunk of the rank (one per virtual stage it holds, `Plan.chunk_layers`) goes through the chunk steps
(`CHUNK_STEPS`), one chunk after the other; then the rank's chunks together go through the rank steps
(`RANK_STEPS`). The order is written once, in those two tuples; `BuiltRank.applied` lists the steps as they ran.

Everything up to `materialize` happens on the meta device (shapes, no storage), so that sharding costs nothing and
`materialize` gives a rank storage for its own shards only, never a whole chunk. The order, and what each step needs
from the ones before it:

Chunk steps, for each chunk in turn:
1. meta: the family's stage for the chunk's layers under `torch.device("meta")`, first / last by its virtual
   stage, holding only this rank's experts (expert parallelism: `Plan.experts_of`).
2. tensor_parallel (tp > 1): `apply_tensor_parallel` shards the base's parameters over the tp mesh (DTensors, from
   no values: `src_data_rank=None`) and registers its styles' hooks. Before the steps that work on its result:
   LoRA (below), FSDP2, which shards tp's DTensors into 2-D (dp, tp) ones (torch's 2-D composition: tp first), and
   compile, which traces the DTensors and the styles' hooks (torchtitan's order).
3. lora (`model.lora`): `apply_lora` freezes every parameter and adds the adapters. After tp: each adapter is split
   as the family's tp plan splits its base, and its forward hook on the base's linear runs after the hooks tp
   registered there (hooks run in registration order), so it adds to the base's output as the style leaves it (a
   local column shard, or the residual stream's layout), bringing the adapter's output to that layout. Before
   FSDP2, which shards the parameters a unit holds when it wraps it (the adapters must be there), and the
   reducers, which take the trainable parameters only (`requires_grad`); before compile, whose split-backward mode
   (`keep_matmuls_eager`) makes eager each `nn.Linear` a block holds when it runs, the adapters' only if added.
4. recompute: `activation_checkpointing` (flags on the family's modules, or the stage's `recompute_blocks` for
   full) and `activation_offload`. Before compile: `compile_blocks` reads `recompute_blocks` and, for full
   recompute, moves the checkpoint inside each compiled block and turns the stage's own off; set after it, the
   flag would be on again and the stage would checkpoint around the compiled blocks, not the composition
   `parallel.runtime.compile` chose (torchtitan's: the compiler sees what backward recomputes). Neither tp nor
   LoRA replaces the modules it flags: after them is torchtitan's order (tp, then AC), not a need.
5. compile_blocks (`compile: true`): each block compiled in place (`parallel.runtime.compile`), after tp, LoRA and
   recompute as that module says; under a split-backward schedule (zb-h1, zbv) its linears stay eager. FSDP2
   wraps the compiled blocks afterwards, torchtitan's order (compile, then fully_shard).
6. moe_context: each MoE layer's groups (tp, ep) and its losses' normaliser (the sequences of the step, or of the
   replica's share with local_sgd and diloco). Read at the layer's forward only: it needs nothing of the steps
   before but the layers of step 1, and nothing after it reads it.

Rank steps, over the rank's chunks together:
7. fsdp (ZeRO-2/3): `shard_chunks` wraps each chunk's units (embedding, blocks, head) and its MoE routers and
   experts with FSDP2, still on the meta device. After every chunk step: it shards the final parameters (tp's
   DTensors, LoRA's adapters) and replaces each parameter of a unit with its sharded DTensor, the object every step
   after holds.
8. materialize: `to_empty` on the rank's device (storage for this rank's shards only: after all sharding, tp, ep
   and FSDP2, or it would be whole), then every parameter from its (seed, name) value, sliced, unless `init_from`
   gives the base (`fill=False`; LoRA's adapters are always filled), and the buffers (`parallel.runtime.materialize`).
9. init_from: the Hugging Face checkpoint read slice by slice into the shards (`hf_checkpoint.load_into`, which
   reads each parameter's block from its placements: after the sharding, and into storage: after materialize),
   then a PEFT adapter over the adapters' init.
10. fsdp_ready (ZeRO-2/3): FSDP2's lazy initialisation of each root, which its first forward would run
    (`ShardedChunks.ready`). After materialize: FSDP2 refuses meta parameters. After init_from, so that it runs
    once the parameters hold their values, as a first forward would find them.
11. tied: `TiedEmbeddings` takes the copies of a tied embedding this rank holds and marks each for a bucket of its
    own. After fsdp (it keeps the parameter objects, which FSDP2 replaces) and after materialize (`to_empty` swaps
    each parameter's contents with `torch.utils.swap_tensors`, its `__dict__` included: a mark set before would be
    lost); before the reducers, which read the mark when they bucket.
12. reducers: `make_reducer` per set of parameters (dense, router, experts, each over its own group), the
    compressor (`parallel.grad_compression`) with them. After materialize (a bucket is allocated on the parameters'
    device and its views become their `.grad`; ZeRO-1 hands the optimizer views of the parameters' storage), after
    lora (`requires_grad`), fsdp (ZeRO-2/3's parameters are FSDP2's to reduce) and tied (the marks).
13. optimizer: `TrainOptimizer` over what the reducers hand it (after them), and with the offloaded optimizer
    overlapped, each forward unit waiting for its host step (`wait_in_forward`). After init_from: offloaded, it
    copies the parameters' values to the host as it is built.

What follows in `RankTrainer` reads the build and wires the step: the replica sync (local_sgd, diloco) over the
trainable parameters, the rank's state (`RankState`) and the pipeline executor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trainyard.parallel.runtime.compile as regional_compile
import trainyard.parallel.runtime.materialize as materializing
from trainyard.parallel.config import JobConfig
from trainyard.parallel.io import hf_checkpoint, peft_adapter
from trainyard.parallel.models.components.decoder import DecoderStage
from trainyard.parallel.models.components.lora import apply_lora
from trainyard.parallel.models.components.moe import MoEContext, moe_layers
from trainyard.parallel.plan import Plan
from trainyard.parallel.plan.layout import RankCoords
from trainyard.parallel.plan.schedule.actions import virtual_stage
from trainyard.parallel.plan.sharding import Sharding
from trainyard.parallel.runtime.compression import Compressor, make_compressor
from trainyard.parallel.runtime.distributed import RankGroups
from trainyard.parallel.runtime.dp.data_parallel import Reducer, make_reducer
from trainyard.parallel.runtime.dp.fsdp import ShardedChunks, shard_chunks
from trainyard.parallel.runtime.host_steps import forward_units, wait_in_forward
from trainyard.parallel.runtime.pipeline.tied import TiedEmbeddings
from trainyard.parallel.runtime.tp.tensor_parallel import apply_tensor_parallel
from trainyard.parallel.runtime.train_optimizer import TrainOptimizer


@dataclass
class RankBuild:
    """A rank's build in progress: what the steps so far have made, for the steps after them."""

    plan: Plan
    rank: int
    groups: RankGroups
    device: torch.device
    chunks: list[DecoderStage] = field(default_factory=list)
    sharded: ShardedChunks | None = None
    """ZeRO-2/3: the chunks as FSDP2 wrapped them (`fsdp`)."""
    tied: TiedEmbeddings | None = None
    compressor: Compressor | None = None
    reducers: dict[str, Reducer] = field(default_factory=dict)
    optimizer: TrainOptimizer | None = None
    applied: list[str] = field(default_factory=list)
    """The steps run so far, by name, in order (a chunk step once per chunk)."""

    @property
    def cfg(self) -> JobConfig:
        return self.plan.config

    @property
    def coords(self) -> RankCoords:
        return self.plan.coords(self.rank)

    @property
    def sharding(self) -> Sharding:
        """The ZeRO strategy (`parallel.zero`): which steps shard what."""
        return self.plan.sharding


@dataclass(frozen=True)
class BuiltRank:
    """A rank as `build_rank` built it: what `RankTrainer` steps."""

    chunks: list[DecoderStage]
    sharded: ShardedChunks | None
    tied: TiedEmbeddings
    compressor: Compressor | None
    reducers: dict[str, Reducer]
    optimizer: TrainOptimizer
    applied: tuple[str, ...]


ChunkStep = Callable[[RankBuild, int], None]
"""A step applied to one chunk (by its index among the rank's chunks)."""
RankStep = Callable[[RankBuild], None]
"""A step applied to the rank's chunks together."""


def meta(b: RankBuild, chunk: int) -> None:
    """1. The chunk's stage on the meta device: shapes, no storage; this rank's experts only."""
    v = virtual_stage(b.coords.pp, chunk, b.plan.pp, b.plan.placement)
    layers = b.plan.chunk_layers(b.coords.pp)[chunk]
    with torch.device("meta"):
        stage = b.plan.family.build_stage(
            b.cfg.model, layers, first=v == 0, last=v == b.plan.n_virtual_stages - 1, seed=b.cfg.seed,
            experts=b.plan.experts_of(b.rank))
    b.chunks.append(stage)


def tensor_parallel(b: RankBuild, chunk: int) -> None:
    """2. tp > 1: the chunk sharded over the tp mesh (and sequence parallelism's layouts with `parallel.sp`)."""
    if b.groups.tp_mesh is not None:
        apply_tensor_parallel(b.chunks[chunk], b.groups.tp_mesh, sequence_parallel=b.plan.parallel.sp)


def lora(b: RankBuild, chunk: int) -> None:
    """3. `model.lora`: the base frozen, the adapters added, split to match their (sharded) base."""
    if b.cfg.model.lora is not None:
        apply_lora(b.chunks[chunk], seed=b.cfg.seed, tp_mesh=b.groups.tp_mesh,
                   sequence_parallel=b.plan.parallel.sp)


def recompute(b: RankBuild, chunk: int) -> None:
    """4. `activation_checkpointing` and `activation_offload`."""
    b.chunks[chunk].set_activation_checkpointing(b.cfg.activation_checkpointing)
    b.chunks[chunk].set_activation_offload(b.cfg.activation_offload)


def compile_blocks(b: RankBuild, chunk: int) -> None:
    """5. `compile: true`: each block compiled in place."""
    if b.cfg.compile:
        # a split backward (zb-h1, zbv) needs each linear's weight gradient apart from its input's: linears eager
        regional_compile.compile_blocks(b.chunks[chunk],
                                        separable_weights=b.plan.schedule.splits_backward)


def moe_context(b: RankBuild, chunk: int) -> None:
    """6. Each MoE layer's groups and the normaliser of its auxiliary losses."""
    # The auxiliary losses are normalised like the token loss: by the sequences of the step's batch, or of the
    # replica's share of it with local_sgd and diloco (a replica of reduce_dp of the dp ranks)
    for _, layer in moe_layers(b.chunks[chunk]):
        layer.context = MoEContext(sequences_per_step=b.cfg.global_batch * b.plan.reduce_dp // b.plan.dp,
                                   tp_group=b.groups.tp, ep_group=b.groups.ep)


def fsdp(b: RankBuild) -> None:
    """7. ZeRO-2/3: FSDP2 shards each chunk per unit (its embedding, each block, its head; routers and experts on
    their own groups) over the same groups as the reducers (`parallel.runtime.dp.fsdp`), on the meta device."""
    par = b.plan.parallel
    if b.sharding.shards_parameters:
        b.sharded = shard_chunks(b.chunks, b.groups.dp_mesh, b.groups.stage, b.groups.experts, b.sharding,
                                 par.reduce_dtype, b.device.type)


def materialize(b: RankBuild) -> None:
    """8. Storage for this rank's shards and every parameter's values from (seed, name), or, with `init_from`, the
    adapters' alone (`init_from` gives the rest next; a checkpoint loaded later replaces them all)."""
    materializing.materialize(b.chunks, b.device, seed=b.cfg.seed, fill=b.cfg.init_from is None)


def init_from(b: RankBuild) -> None:
    """9. `init_from`: the start's weights read slice by slice into the shards (`load_into` checks first that the
    checkpoint names every parameter), then a PEFT adapter's."""
    cfg = b.cfg
    if cfg.init_from is not None:
        assert cfg.init_from.hf is not None, "a rule: init_from.hf (or a job_id the service resolved to it)"
        hf_checkpoint.load_into(b.chunks, cfg.model, Path(cfg.init_from.hf))
        if cfg.init_from.adapter is not None:  # LoRA continued from a PEFT adapter
            peft_adapter.load_into(b.chunks, cfg.model, Path(cfg.init_from.adapter))


def fsdp_ready(b: RankBuild) -> None:
    """10. ZeRO-2/3: each FSDP2 root initialised, as its first forward would."""
    if b.sharded is not None:
        b.sharded.ready()


def tied(b: RankBuild) -> None:
    """11. Tied embeddings in two chunks: the two copies' gradients in buckets of their own, summed every step."""
    b.tied = TiedEmbeddings(b.chunks, b.groups.tied)
    b.tied.mark()


def reducers(b: RankBuild) -> None:
    """12. A reducer per set of parameters, and the gradient compressor they send through."""
    cfg, groups = b.cfg, b.groups
    par = b.plan.parallel
    # Each set of gradients is summed over the ranks that computed parts of it (see parallel.models.components.moe):
    # dense parameters over dp, routers over the whole stage, experts over the ranks holding the same experts.
    # local_sgd, diloco: a replica is `plan.reduce_dp` dp ranks (`groups.reduce`), which reduce, shard and spread
    # experts among themselves as allreduce's dp ranks do.
    sets = groups.reducing  # parallel.plan.reduction_sets
    family, sharding = b.plan.family, b.sharding
    b.compressor = make_compressor(par.grad_compression, cfg.seed)
    for kind, group in sets.items():
        # a frozen parameter (LoRA's base) has no gradient to reduce and no optimizer state
        per_chunk = [[p for n, p in chunk.named_parameters() if family.reduction_set(n) == kind and p.requires_grad]
                     for chunk in b.chunks]
        if any(per_chunk):
            b.reducers[kind] = make_reducer(per_chunk, group, sharding, reduce_dtype=par.reduce_dtype,
                                            sharded=b.sharded, compressor=b.compressor,
                                            shared_memory=par.shared_memory_reduce)


def optimizer(b: RankBuild) -> None:
    """13. The optimizer over what the reducers hand it."""
    cfg = b.cfg
    # Offloaded: the optimizer's chunks follow the forward's units; overlapped, each unit's forward waits for its
    # own chunks' host step (`parallel.runtime.host_steps`), where nothing else reads the parameters in between.
    units = forward_units(b.chunks) if cfg.optimizer.offload else []
    overlap = (cfg.optimizer.offload_overlap and not cfg.compile
               and not any(r.zero for r in b.reducers.values()))
    b.optimizer = TrainOptimizer([pair for r in b.reducers.values() for pair in r.optimizer_params()],
                                 cfg.optimizer, offload=cfg.optimizer.offload, overlap=overlap,
                                 units=[[p for m in unit for p in m.parameters()] for unit in units] or None)
    if b.optimizer.overlap:
        wait_in_forward(units, b.optimizer.ready)


CHUNK_STEPS: tuple[ChunkStep, ...] = (meta, tensor_parallel, lora, recompute, compile_blocks, moe_context)
"""Steps 1-6 of the module docstring, applied to each chunk in turn."""
RANK_STEPS: tuple[RankStep, ...] = (fsdp, materialize, init_from, fsdp_ready, tied, reducers, optimizer)
"""Steps 7-13 of the module docstring, applied to the rank's chunks together."""


def build_rank(plan: Plan, rank: int, groups: RankGroups, device: torch.device, *,
               after: Callable[[str, RankBuild], None] | None = None) -> BuiltRank:
    """Rank `rank` of `plan` on `groups` and `device`, built by `CHUNK_STEPS` for each chunk, then `RANK_STEPS`;
    `after(name, build)` is called after each step (a test looks at the build in progress there)."""
    b = RankBuild(plan, rank, groups, device)

    def done(name: str) -> None:
        b.applied.append(name)
        if after is not None:
            after(name, b)

    for chunk in range(len(plan.chunk_layers(b.coords.pp))):
        for chunk_step in CHUNK_STEPS:
            chunk_step(b, chunk)
            done(chunk_step.__name__)
    for rank_step in RANK_STEPS:
        rank_step(b)
        done(rank_step.__name__)
    assert b.tied is not None and b.optimizer is not None  # steps 11 and 13
    return BuiltRank(b.chunks, b.sharded, b.tied, b.compressor, b.reducers, b.optimizer, tuple(b.applied))
