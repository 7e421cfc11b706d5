"""The rules that relate several fields of a JobConfig, each returning its violations.

Every function here returns a list of `PlanError`s (a `RuleError`: the field to change and the rule it
breaks), empty when the config keeps the rule; nothing raises, so a planner can ask which candidate configs
are valid without try/except. Each reads the config with its strategies resolved once
(`parallel.plan.sizing.Resolved`: `r.parallel`, `r.sharding`, `r.schedule`, `r.optimizer`, `r.family`).
`parallel.plan.make_plan` raises the first violation (what the API answers with a 422). The order of the list
is the order the rules are checked in, which is the order the user is told about them. Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import replace

from trainyard.parallel.config import JobConfig, ParallelConfig, RuleError
from trainyard.parallel.plan.planner.search_options import searched_values, with_option
from trainyard.parallel.plan.schedule.actions import ScheduleError
from trainyard.parallel.plan.schedule.schedules import check_schedule_args
from trainyard.parallel.plan.sizing import Resolved, fixed_parallel
from trainyard.parallel.plan.sync.gossip_peers import gossip_violation
from trainyard.parallel.plan.sync.replica_sync import LOCAL_KINDS, is_local, replica_dp


class PlanError(RuleError):
    """A JobSpec whose fields do not fit together, or a job the cluster can never hold."""


MAX_WORKERS = 2**16
MAX_SCHEDULE_CHUNKS = 2**15
"""pp x vpp x microbatches: the size of the action lists the plan builds and simulates (about 0.1 ms of
planning each). At real jobs' largest: Megatron's 1T run (pp=64, m=512) is at the bound."""


def violations(config: JobConfig) -> list[PlanError]:
    """Every cross-field rule a fixed-size config breaks, in the order they are reported. Empty: the
    config can be laid out (whether a cluster can hold it is `parallel.plan.admission`'s question)."""
    return degree_violations(config) + stage_layer_violations(config)


def layout_free_violations(config: JobConfig) -> list[PlanError]:
    """The rules no layout can keep or break: every rule a one-rank layout breaks outside `parallel` and the options
    the planner searches (`search_options.SEARCHED`, each at its first value): the model's, the data's, the
    optimizer's. What a `parallel: auto` job is told at submit before any layout is chosen, and before the node
    type's costs are known (a fixed layout is told the same by `violations`)."""
    one_rank = replace(config, parallel=ParallelConfig())
    searched = searched_values(one_rank)
    for path, values in searched.items():
        one_rank = with_option(one_rank, path, values[0])
    return [e for e in degree_violations(one_rank)
            if e.field.split(".")[0] != "parallel" and e.field not in searched]


def degree_violations(config: JobConfig) -> list[PlanError]:
    """Every rule but the split of the blocks into stages: what must hold before the degrees mean anything
    (`make_plan` asks whether the cluster can hold that many workers before it splits the blocks)."""
    r = Resolved(config)
    return [*model_violations(r), *expert_violations(r), *tensor_parallel_violations(r), *size_violations(r),
            *batch_violations(r), *schedule_violations(r), *sharding_violations(r), *compression_violations(r),
            *sync_violations(r), *optimizer_violations(r), *packing_violations(r), *context_parallel_violations(r)]


CP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""The families whose attention runs the ring (`parallel.runtime.cp`): Llama's attention and its subclasses."""


def context_parallel_violations(r: Resolved) -> list[PlanError]:
    """cp splits every sequence into 2 x cp chunks (head-tail balanced) and runs causal attention as a ring inside a
    replica. What it does not compose with yet is refused naming both fields."""
    par, config = r.parallel, r.config
    cp = par.cp
    if cp == 1:
        return []
    errors = []
    if config.model.seq_len % (2 * cp):
        errors.append(PlanError("parallel.cp", f"cp={cp} splits each sequence into 2 x cp = {2 * cp} chunks: it must "
                                               f"divide model.seq_len={config.model.seq_len}"))
    if config.model.family not in CP_FAMILIES:
        errors.append(PlanError("parallel.cp", f"cp={cp} with model.family={config.model.family}: the ring attention "
                                               f"runs in {', '.join(CP_FAMILIES)}'s attention only"))
    if par.sp and (config.model.seq_len // cp) % par.tp:
        errors.append(PlanError("parallel.sp", f"sp=true splits each rank's {config.model.seq_len // cp} tokens "
                                               f"(seq_len / cp) over tp={par.tp}: tp must divide them"))
    others = (("model.moe", config.model.moe is not None, "mixture-of-experts routing"),
              ("parallel.sync.kind", par.sync.kind != "allreduce", f"{par.sync.kind} replicas"),
              ("compile", config.compile, "torch.compile'd blocks"))
    errors += [PlanError("parallel.cp", f"cp={cp} does not compose with {field} ({what}) yet: use cp: 1 or "
                                        f"change {field}") for field, bad, what in others if bad]
    return errors


def packing_violations(r: Resolved) -> list[PlanError]:
    """Packed examples (`data.packing: true`) give every micro-batch its own positions and attention mask, read
    by the attention modules from an attribute the executor sets before each action."""
    config = r.config
    if not config.data.packing:
        return []
    errors = []
    if config.compile:  # dynamo would guard on the per-micro-batch tensors it reads from a module attribute
        errors.append(PlanError("compile", "data.packing: true gives each micro-batch its own attention mask and "
                                           "positions, which torch.compile'd blocks do not read yet; use "
                                           "compile: false or data.packing: false"))
    family = r.family
    if family.learned_positions and r.parallel.sp:
        errors.append(PlanError("parallel.sp", f"data.packing: true restarts {family.name}'s learned positions at "
                                               f"each example, per row, and sequence parallelism slices "
                                               f"{family.name}'s position embedding as one (seq_len, d_model) table: "
                                               "use sp: false"))
    return errors


def optimizer_violations(r: Resolved) -> list[PlanError]:
    """AdamW's decays must be below 1 (`OptimizerKind.adam_betas`): at 1 its bias correction divides by
    1 - beta**t = 0 (torch refuses it as the ranks build the optimizer, so the job failed after admission). sgd
    takes momentum 1; adafactor reads neither."""
    opt = r.config.optimizer
    if not r.optimizer.adam_betas:
        return []
    return [PlanError(f"optimizer.{name}", f"{name}={value} with kind {opt.kind}: must be below 1 (AdamW divides by "
                                           f"1 - {name}**step)")
            for name, value in (("beta1", opt.beta1), ("beta2", opt.beta2)) if value >= 1]


def size_violations(r: Resolved) -> list[PlanError]:
    """Bounds on what the plan would build: the rank grid and the schedule's action lists."""
    par, errors = r.parallel, []
    workers = par.fixed_dp * par.cp * par.pp * par.tp
    if workers > MAX_WORKERS:
        errors.append(PlanError("parallel.dp", f"dp x cp x pp x tp = {par.dp} x {par.cp} x {par.pp} x {par.tp} = "
                                               f"{workers} "
                                               f"workers; at most {MAX_WORKERS}"))
    chunks = par.pp * par.vpp * par.microbatches
    if chunks > MAX_SCHEDULE_CHUNKS:
        errors.append(PlanError("parallel.microbatches",
                                f"pp x vpp x microbatches = {par.pp} x {par.vpp} x {par.microbatches} = {chunks} "
                                f"chunk forwards per step; at most {MAX_SCHEDULE_CHUNKS}"))
    return errors


def batch_violations(r: Resolved) -> list[PlanError]:
    par, config = r.parallel, r.config
    if config.global_batch % (par.fixed_dp * par.microbatches):
        return [PlanError("global_batch", f"global_batch={config.global_batch} is not divisible by dp x microbatches "
                                          f"= {par.dp} x {par.microbatches} = {par.fixed_dp * par.microbatches}")]
    return []


def model_violations(r: Resolved) -> list[PlanError]:
    config = r.config
    m, errors = config.model, []
    if m.head_dim is None and m.d_model % m.n_head:  # with head_dim the heads need not tile d_model (qwen3)
        errors.append(PlanError("model.n_head", f"n_head={m.n_head} does not divide d_model={m.d_model}"))
    if m.seq_len > m.context:
        errors.append(PlanError("model.seq_len", f"seq_len={m.seq_len} exceeds the model context "
                                                 f"context_len={m.context}"))
    if config.data.kind == "text" and m.vocab_size < 256:
        errors.append(PlanError("model.vocab_size", f"data.kind=text uses byte tokens and needs vocab_size >= 256 "
                                                    f"(got {m.vocab_size})"))
    if config.data.kind in ("text", "tokens") and not config.data.path and not config.data.sources:
        errors.append(PlanError("data.path", f"data.kind={config.data.kind} needs a path (or, for tokens, sources)"))
    errors += lora_violations(r)
    # the family's own rules (parallel.models)
    errors += [PlanError(error.field, error.message) for error in r.family.check(config, r.parallel)]
    return errors


def lora_violations(r: Resolved) -> list[PlanError]:
    """`model.lora.targets` are the family's projections, each once; an adapter to start from needs `model.lora`."""
    config = r.config
    lora, known = config.model.lora, r.family.lora_targets
    errors = []
    if lora is not None:
        unknown = [t for t in lora.targets if t not in known]
        if unknown:
            errors.append(PlanError("model.lora.targets", f"{unknown} are not projections of family "
                                                          f"{config.model.family}; its targets are {list(known)}"))
        if len(set(lora.targets)) != len(lora.targets):
            errors.append(PlanError("model.lora.targets", f"{list(lora.targets)} names a projection twice"))
    if config.init_from is not None and config.init_from.hf is None:
        errors.append(PlanError("init_from", "give init_from.hf (a Hugging Face directory) or init_from.job_id (one "
                                             "of your ended jobs; the service resolves it to its model)"))
    if config.init_from is not None and config.init_from.adapter is not None and lora is None:
        errors.append(PlanError("init_from.adapter", "an adapter to start from needs model.lora (its rank and "
                                                     "targets)"))
    return errors


def expert_violations(r: Resolved) -> list[PlanError]:
    config = r.config
    moe, ep, dp = config.model.moe, r.parallel.ep, r.parallel.fixed_dp
    if moe is None:
        return [PlanError("parallel.ep", f"ep={ep} needs mixture-of-experts layers (model.moe)")] if ep > 1 else []
    errors = []
    if moe.top_k > moe.experts:
        errors.append(PlanError("model.moe.top_k", f"top_k={moe.top_k} exceeds experts={moe.experts} (a token is "
                                                   "routed to top_k different experts)"))
    if moe.every > config.model.n_layer:
        errors.append(PlanError("model.moe.every", f"every={moe.every} exceeds n_layer={config.model.n_layer}: no "
                                                   "block would be a mixture-of-experts block"))
    if dp % ep:
        errors.append(PlanError("parallel.ep", f"ep={ep} does not divide dp={dp} (expert-parallel groups are carved "
                                               "out of the data-parallel ranks)"))
    if moe.experts % ep:
        errors.append(PlanError("parallel.ep", f"ep={ep} does not divide experts={moe.experts} (each "
                                               "expert-parallel rank hosts experts / ep experts)"))
    tp = r.parallel.tp
    if tp > 1 and config.model.seq_len % tp:
        errors.append(PlanError("parallel.tp", f"tp={tp} does not divide seq_len={config.model.seq_len} (each "
                                               "tensor-parallel rank routes one slice of every sequence to the "
                                               "experts)"))
    return errors


def tensor_parallel_violations(r: Resolved) -> list[PlanError]:
    """tp splits heads, the vocabulary (embedding and head) and, with sp, the sequence: each must divide evenly."""
    m, tp, sp, errors = r.config.model, r.parallel.tp, r.parallel.sp, []
    if m.n_head % tp:
        errors.append(PlanError("parallel.tp", f"tp={tp} does not divide n_head={m.n_head} (attention heads are "
                                               "split across tensor-parallel ranks)"))
    if m.vocab_size % tp:
        errors.append(PlanError("parallel.tp", f"tp={tp} does not divide vocab_size={m.vocab_size} (the embedding "
                                               "and the output head are split over the vocabulary)"))
    if sp and tp == 1:
        errors.append(PlanError("parallel.sp", "sp=true needs tp > 1 (sequence parallelism shards over the "
                                               "tensor-parallel ranks)"))
    if sp and m.seq_len % tp:
        errors.append(PlanError("parallel.sp", f"sp=true splits the sequence over tp: tp={tp} does not divide "
                                               f"seq_len={m.seq_len}"))
    return errors


def schedule_violations(r: Resolved) -> list[PlanError]:
    config, par = r.config, r.parallel
    costs = config.sim_costs
    try:
        check_schedule_args(par.schedule, par.pp, par.microbatches, par.vpp)
    except ScheduleError as e:
        return [PlanError("parallel.schedule", str(e))]
    if r.schedule.splits_backward and config.compile and config.activation_checkpointing == "full":
        # Measured (torch 2.13, aot_eager): a block with eager linears (`parallel.runtime.compile`) checkpointed
        # inside its compiled region compiled nothing (dynamo skips a checkpoint whose function breaks the graph),
        # and checkpointed around it failed in backward (recomputed tensors saved in another order).
        return [PlanError("activation_checkpointing", f"{par.schedule} with compile keeps each block's linears "
                                                      "outside the compiled regions, and torch cannot checkpoint a "
                                                      "whole block across them (compiled, nothing would compile; "
                                                      "around the compiled block, backward fails); use "
                                                      "activation_checkpointing: selective or none, or a schedule "
                                                      "without split backward (1f1b, interleaved-1f1b)")]
    if r.schedule.delays_update:
        # 2bw swaps the older weight version into the parameters around a step's compute: whole local tensors,
        # stepped on the device, by the one replica (a sharded or offloaded copy, or a replica stepping alone,
        # would step another version than the one swapped back)
        held = [name for name, on in (("parallel.zero", par.zero > 0), ("optimizer.offload", config.optimizer.offload),
                                      ("parallel.sync", is_local(par.sync))) if on]
        if held:
            return [PlanError(held[0], f"{par.schedule} (PipeDream-2BW's two weight versions) runs at zero 0, "
                                       "without optimizer.offload and with sync allreduce only, so far")]
    if costs.backward_weight is not None and costs.backward_weight > costs.backward:
        return [PlanError("sim_costs.backward_weight", f"backward_weight={costs.backward_weight} exceeds "
                                                       f"backward={costs.backward}: it is a part of the backward")]
    return []


def parameter_server_violations(r: Resolved) -> list[PlanError]:
    """A parameter server's replicas are single dp ranks whose whole parameters and gradients go to the shards: no
    pipeline or tensor parallelism inside a replica, nothing sharded or compressed over dp, yet. The shards own the
    optimizer state, which no checkpoint holds yet: no checkpoints between steps, no resume."""
    config, par, sync = r.config, r.parallel, r.parallel.sync
    errors = [PlanError(f"parallel.{name}", f"{name}={degree} with parallel.sync.kind parameter_server: each replica "
                                            "is one data-parallel rank holding the whole model (a pipeline or "
                                            f"tensor-parallel replica is not supported yet): set {name}: 1")
              for name, degree in (("pp", par.pp), ("tp", par.tp), ("ep", par.ep), ("cp", par.cp)) if degree > 1]
    held = [(field, why) for field, on, why in (
        ("parallel.zero", par.zero > 0, f"zero={par.zero}: the server shards own the optimizer state: set zero: 0"),
        ("optimizer.offload", config.optimizer.offload, "optimizer.offload: the server shards own the optimizer "
                                                        "state: leave offload out"),
        ("parallel.grad_compression", par.grad_compression is not None, "the replicas push their gradients "
                                                                         "uncompressed: leave grad_compression out"),
        ("parallel.sync.replicas", sync.replicas is not None, "its replicas are its dp ranks: leave replicas out"),
        ("parallel.sync.staleness", bool(sync.staleness) and sync.consistency != "ssp",
         f"staleness={sync.staleness} with consistency {sync.consistency}: only ssp reads it (bsp is 0, asp "
         "unbounded)"),
        # A checkpoint holds the ranks' state; the shards' optimizer moments are in no checkpoint yet, so one between
        # steps (or a resume from one) would go on with fresh moments: the job's final checkpoint holds the model.
        ("checkpoint.every", config.checkpoint.every > 0, f"every={config.checkpoint.every}: the server shards' "
                                                          "optimizer state is not checkpointed yet: set every: 0 "
                                                          "(the final checkpoint and the model are written)"),
        ("resume_from", config.resume_from is not None, "the server shards' optimizer state is not checkpointed "
                                                        "yet: a parameter_server job starts from its init"))
        if on]
    return errors + [PlanError(field, f"parallel.sync.kind parameter_server with {why}") for field, why in held]


def sync_violations(r: Resolved) -> list[PlanError]:
    """local_sgd and diloco replicas step alone between synchronisations: each must hold its whole state, so
    what is sharded (ZeRO) or spread (MoE's experts at ep > 1) is within a replica (`parallel.sync.replicas`)."""
    config, par = r.config, r.parallel
    sync = par.sync
    if sync.kind == "parameter_server":
        return parameter_server_violations(r)
    if not is_local(sync):
        if sync.replicas is not None:
            return [PlanError("parallel.sync.replicas", f"replicas={sync.replicas} with kind {sync.kind}: only "
                                                        f"{_and(LOCAL_KINDS)} replicas step apart ({sync.kind}'s "
                                                        "ranks are one replica)")]
        return []
    dp = par.fixed_dp
    if sync.replicas is not None and dp % sync.replicas:
        return [PlanError("parallel.sync.replicas", f"replicas={sync.replicas} does not divide dp={dp} (each "
                                                    "replica is dp / replicas data-parallel ranks)")]
    errors, in_replica = [], replica_dp(sync, dp)
    if r.sharding.shards_optimizer_state and in_replica == 1:
        errors.append(PlanError("parallel.sync.replicas", f"parallel.zero={par.zero} shards the state over the "
                                                          f"data-parallel ranks of a replica, and {sync.kind}'s "
                                                          f"replicas are {in_replica} rank each (replicas="
                                                          f"{sync.replicas or dp}): set replicas below dp={dp}, "
                                                          "e.g. dp / 2, or zero: 0"))
    if config.model.moe is not None and in_replica % par.ep:
        errors.append(PlanError("parallel.sync.replicas", f"ep={par.ep} does not divide the {in_replica} "
                                                          f"data-parallel ranks of each {sync.kind} replica "
                                                          f"(replicas={sync.replicas or dp}): a replica must hold "
                                                          "every expert"))
    if par.grad_compression is not None:
        errors.append(PlanError("parallel.grad_compression", f"compresses the gradients' all-reduce across the "
                                                             f"replicas, which {sync.kind} does not run (its replicas "
                                                             "average their parameters every parallel.sync.every "
                                                             "steps instead): leave one of the two out"))
    if sync.kind == "gossip":
        reason = gossip_violation(dp // replica_dp(sync, dp), sync.peers)
        if reason is not None:
            errors.append(PlanError("parallel.sync.peers", f"{reason}: each gossip replica averages with as many "
                                                           "others as every other replica does"))
    every = config.checkpoint.every
    # Only the saves before the last step count: the job's final checkpoint follows the last step's sync.
    if every and every < config.steps and every % sync.every:
        errors.append(PlanError("checkpoint.every", f"checkpoint.every={every} is not a multiple of "
                                                    f"parallel.sync.every={sync.every}: a checkpoint holds one model, "
                                                    "which the replicas share only right after a synchronisation"))
    return errors


def _and(names: tuple[str, ...]) -> str:
    """("a", "b", "c") -> "a, b and c"."""
    return " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def stage_layer_violations(config: JobConfig) -> list[PlanError]:
    """The blocks must split into pp x vpp stages of at least one block (or as the explicit list says)."""
    par = fixed_parallel(config)
    n_layer, n_stages, counts = config.model.n_layer, par.pp * par.vpp, par.stage_layers
    if counts is None:
        if n_layer < n_stages:
            return [PlanError("parallel.pp", f"n_layer={n_layer} cannot be split into pp x vpp = {n_stages} "
                                             "stages of at least one block each")]
    elif len(counts) != n_stages:
        return [PlanError("parallel.stage_layers", f"has {len(counts)} entries but pp x vpp = {n_stages} stages")]
    elif sum(counts) != n_layer:
        return [PlanError("parallel.stage_layers", f"sums to {sum(counts)} but n_layer={n_layer}")]
    return []


def sharding_violations(r: Resolved) -> list[PlanError]:
    """ZeRO-2/3 are FSDP2's (`parallel.runtime.dp.fsdp`), which reduce-scatters each chunk's gradients during its
    backward: there is no reduction left to run after backward."""
    par = r.parallel
    if r.sharding.shards_parameters and not par.overlap_reduce:
        return [PlanError("parallel.overlap_reduce", f"overlap_reduce=false needs zero <= 1 (zero={par.zero} "
                                                     "reduce-scatters each chunk's gradients during its backward)")]
    return []


def compression_violations(r: Resolved) -> list[PlanError]:
    """A compressor that needs whole gradients (`CompressionKind.whole_gradients`; PowerSGD approximates whole
    gradient matrices and keeps a whole-size error per rank) composes with ZeRO-1 (whole gradients, sharded
    optimizer state), not with ZeRO-2/3, which keep only a shard of each gradient."""
    par, cfg, compressor = r.parallel, r.parallel.grad_compression, r.compression
    if cfg is None or compressor is None or not r.sharding.shards_parameters:
        return []
    if (why := compressor.whole_gradients) is not None:
        return [PlanError("parallel.grad_compression",
                          f"{cfg.kind} needs every rank's whole gradients ({why}); parallel.zero={par.zero} "
                          f"keeps only a shard of them: use zero 0 or 1, or no grad_compression")]
    return []
