"""A config with its names resolved (`Resolved`), and `Sizing`: that and a layout read as one object, which is what
the memory and FLOP counting reads (`plan.tp`, `plan.stage_layers`, `plan.sharding`, `plan.config.model`, ...). A
`parallel.plan.Plan` is a Sizing (and an elastic job's range).

Each strategy a config names is looked up in its registry here, once, when the object is made: `parallel.zero`'s
sharding (`parallel.plan.sharding.SHARDINGS`), `parallel.schedule`'s pipeline schedule
(`parallel.plan.schedule.schedules.SCHEDULES`), `optimizer.kind`'s optimizer (`parallel.optim.kinds.OPTIMIZERS`) and
`model.family`'s family (`parallel.models.FAMILIES`); with them `parallel`, written out (`fixed_parallel`). Everything
after reads the entries (`plan.sharding.shards_parameters`), never the names again. The rules, which run on a bare
config before there is a layout, read `Resolved(config)`.

Its own module, below `memory` and the model families: counting code types its argument with it instead of
importing `parallel.plan` (which imports the memory plan: that was the circle). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from trainyard.parallel.config import JobConfig, ParallelConfig, RuleError
from trainyard.parallel.models import FAMILIES
from trainyard.parallel.models.base import ModelFamily
from trainyard.parallel.optim.kinds import OPTIMIZERS, OptimizerKind
from trainyard.parallel.plan.grad_compression import COMPRESSIONS, CompressionKind
from trainyard.parallel.plan.layout import Layout
from trainyard.parallel.plan.schedule.kind import Schedule
from trainyard.parallel.plan.schedule.schedules import SCHEDULES
from trainyard.parallel.plan.sharding import SHARDINGS, Sharding
from trainyard.parallel.plan.sync.replica_sync import SYNC_KINDS, SyncKind

E = TypeVar("E")


def fixed_parallel(config: JobConfig) -> ParallelConfig:
    """`config.parallel` once the layout is written out: a plan's config, a candidate the planner made, or a spec
    whose layout was written by hand. `parallel: auto` has none yet (RuleError): the planner resolves it on submit
    (the service's, `trainyard plan --auto`), before a plan is made, and the job carries the chosen layout from
    then on. Read outside `parallel/plan` as `plan.parallel` (tests/unit/test_resolved_plan.py holds that)."""
    if isinstance(config.parallel, str):  # "auto"
        raise RuleError("parallel", "parallel: auto is resolved by the planner (the service's submit, "
                                    "`trainyard plan --auto`) before a plan is made")
    return config.parallel


def _derived() -> Any:
    """A field looked up from the config when the object is made: not an argument, not compared, not shown."""
    return field(init=False, repr=False, compare=False)


@dataclass(frozen=True)
class Resolved:
    """A config with a written-out layout, and the registry entry each of its names picks."""

    config: JobConfig
    parallel: ParallelConfig = _derived()
    """`config.parallel`, written out (`fixed_parallel`)."""
    sharding: Sharding = _derived()
    """`parallel.zero`'s data-parallel sharding strategy."""
    schedule: Schedule = _derived()
    """`parallel.schedule`'s pipeline schedule kind (its compute order, placement, whether it splits backward); a
    layout's action lists are `actions`."""
    optimizer: OptimizerKind = _derived()
    """`optimizer.kind`'s optimizer (its state and bytes, how it is built)."""
    family: ModelFamily = _derived()
    """`model.family`'s model family."""
    sync: SyncKind = _derived()
    """`parallel.sync.kind`'s replica sync mode (whether its replicas step apart, what the plan shows of it)."""
    compression: CompressionKind | None = _derived()
    """`parallel.grad_compression.kind`'s compressor (what a matrix sends and keeps), None without compression."""

    def __post_init__(self) -> None:
        parallel, config = fixed_parallel(self.config), self.config
        for name, value in (("parallel", parallel),
                            ("sharding", _entry(SHARDINGS, parallel.zero, "parallel.zero")),
                            ("schedule", _entry(SCHEDULES, parallel.schedule, "parallel.schedule")),
                            ("optimizer", _entry(OPTIMIZERS, config.optimizer.kind, "optimizer.kind")),
                            ("family", _entry(FAMILIES, config.model.family, "model.family")),
                            ("sync", _entry(SYNC_KINDS, parallel.sync.kind, "parallel.sync.kind")),
                            ("compression", None if parallel.grad_compression is None else
                             _entry(COMPRESSIONS, parallel.grad_compression.kind, "parallel.grad_compression.kind"))):
            object.__setattr__(self, name, value)  # frozen: set once, here

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as what it was made from (a registry entry holds functions, which plain pickle refuses): the
        entries are looked up again where it is unpickled (a rank, a Ray actor)."""
        return _made, (type(self), {f.name: getattr(self, f.name) for f in fields(self) if f.init})


def _made(cls: type[Resolved], arguments: dict[str, Any]) -> Resolved:
    return cls(**arguments)


def _entry(registry: Mapping[Any, E], name: object, field_name: str) -> E:
    """The registry's entry for `name`; RuleError naming the field when there is none (the spec's Literals keep
    a parsed spec from naming one, a config made in Python may)."""
    try:
        return registry[name]
    except KeyError:
        raise RuleError(field_name, f"no {field_name} {name!r}; known: {', '.join(map(repr, registry))}") from None


@dataclass(frozen=True)
class Sizing(Resolved):
    """What the counting reads: a layout's attributes (`plan.tp`, `plan.stage_layers`, `plan.actions`, ...), the
    resolved strategies (`plan.sharding`, ...) and `plan.config`."""

    layout: Layout = field(kw_only=True)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("layout", "config"):
            raise AttributeError(name)
        return getattr(self.layout, name)
