"""The names a JobSpec field may take where a registry holds what each one means: the one list of each.

Each registry is built through `registry(NAMES, entries)`, which refuses entries whose keys are not the list here
in its order, so a registry and the spec field that picks from it cannot drift apart (the process fails at import):

- `model.family`: `FamilyName`, the model families (`parallel.models.FAMILIES`);
- `optimizer.kind`: `OptimizerName`, the optimizers (`parallel.optim.kinds.OPTIMIZERS`);
- `optimizer.schedule`: `LrScheduleName`, the learning-rate schedules (`parallel.optim.lr_schedules.LR_SCHEDULES`);
- `parallel.schedule`: `ScheduleKind`, the pipeline schedules (`parallel.plan.schedule.schedules.SCHEDULES`);
- `parallel.zero`: `ZeroLevel`, the data-parallel sharding strategies (`parallel.plan.sharding.SHARDINGS`);
- `parallel.sync.kind`: `SyncName`, the replica sync modes (`parallel.plan.sync.replica_sync.SYNC_KINDS`, and how each
  runs on a rank: `parallel.runtime.sync.SYNCS`);
- `parallel.grad_compression.kind`: `CompressionName`, the gradient compressors
  (`parallel.plan.grad_compression.COMPRESSIONS`, and their reducers: `parallel.runtime.compression.COMPRESSORS`).

The spec's fields are typed with these `Literal`s, so its JSON schema, and docs/jobspec.md written from it, list
the values. A new entry is its registry's line and its name here, in the registry's order (the planner tries the
schedule kinds in it; the families claim a Hugging Face directory in theirs, the transformers backend last).

Why a module of its own, and not `Literal[tuple(REGISTRY)]`: the registries import the config (a family reads
`ModelConfig`, an optimizer `OptimizerConfig`), and the config at parallel's top imports no room
(tests/unit/test_imports.py), so the names sit below both. Pure: typing only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypeVar, get_args

FamilyName = Literal["gpt2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "hf"]
OptimizerName = Literal["adamw", "adamw8bit", "adamw4bit", "adafactor", "sgd"]
LrScheduleName = Literal["cosine", "linear", "constant", "wsd"]
ScheduleKind = Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "2bw"]
ZeroLevel = Literal[0, 1, 2, 3]
SyncName = Literal["allreduce", "local_sgd", "diloco", "gossip", "parameter_server"]
CompressionName = Literal["powersgd", "topk", "qsgd"]

FAMILY_NAMES: tuple[FamilyName, ...] = get_args(FamilyName)
OPTIMIZER_NAMES: tuple[OptimizerName, ...] = get_args(OptimizerName)
LR_SCHEDULE_NAMES: tuple[LrScheduleName, ...] = get_args(LrScheduleName)
SCHEDULE_KINDS: tuple[ScheduleKind, ...] = get_args(ScheduleKind)
"""The pipeline schedule kinds, in the order the planner tries them."""
ZERO_LEVELS: tuple[ZeroLevel, ...] = get_args(ZeroLevel)
SYNC_NAMES: tuple[SyncName, ...] = get_args(SyncName)
COMPRESSION_NAMES: tuple[CompressionName, ...] = get_args(CompressionName)
ConsistencyName = Literal["bsp", "asp", "ssp"]
"""`parallel.sync.consistency` of a parameter server (`parallel.plan.sync.parameter_server.CONSISTENCIES`)."""
CONSISTENCY_NAMES: tuple[ConsistencyName, ...] = get_args(ConsistencyName)

K = TypeVar("K")
V = TypeVar("V")


def registry(names: tuple[K, ...], entries: Mapping[K, V], what: str) -> dict[K, V]:
    """`entries` as the registry `what`, once its keys are `names` in their order; RuntimeError naming both
    otherwise (raised as the registry's module is imported)."""
    if tuple(entries) != names:
        raise RuntimeError(f"{what} registers {list(entries)}, and trainyard.parallel.names lists {list(names)}: "
                           "a registry's keys are the names its spec field takes, in one order")
    return dict(entries)
