"""The registries are the one list of names: each spec field that picks a registry entry takes exactly the names
`parallel.names` lists, which are the registry's keys in its order."""

import typing

import pytest
from trainyard.parallel.config import GradCompressionConfig, ModelConfig, OptimizerConfig, ParallelConfig, SyncConfig
from trainyard.parallel.models import FAMILIES
from trainyard.parallel.names import (
    COMPRESSION_NAMES,
    FAMILY_NAMES,
    LR_SCHEDULE_NAMES,
    OPTIMIZER_NAMES,
    SCHEDULE_KINDS,
    SYNC_NAMES,
    ZERO_LEVELS,
    registry,
)
from trainyard.parallel.optim.kinds import OPTIMIZERS
from trainyard.parallel.optim.lr_schedules import LR_SCHEDULES
from trainyard.parallel.plan.grad_compression import COMPRESSIONS
from trainyard.parallel.plan.schedule.schedules import SCHEDULES
from trainyard.parallel.plan.sharding import SHARDINGS
from trainyard.parallel.plan.sync.replica_sync import SYNC_KINDS
from trainyard.parallel.spec import SPEC_ADAPTER


def _field_values(owner: type, name: str) -> tuple:
    hint = typing.get_type_hints(owner)[name]
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return typing.get_args(hint)


@pytest.mark.parametrize(("owner", "field", "names", "entries"), [
    (ModelConfig, "family", FAMILY_NAMES, FAMILIES),
    (OptimizerConfig, "kind", OPTIMIZER_NAMES, OPTIMIZERS),
    (OptimizerConfig, "schedule", LR_SCHEDULE_NAMES, LR_SCHEDULES),
    (ParallelConfig, "schedule", SCHEDULE_KINDS, SCHEDULES),
    (ParallelConfig, "zero", ZERO_LEVELS, SHARDINGS),
    (SyncConfig, "kind", SYNC_NAMES, SYNC_KINDS),
    (GradCompressionConfig, "kind", COMPRESSION_NAMES, COMPRESSIONS),
])
def test_each_spec_field_takes_its_registrys_names_in_its_order(owner, field, names, entries):
    assert _field_values(owner, field) == names == tuple(entries)


def test_the_json_schema_lists_the_registered_names():
    defs = SPEC_ADAPTER.json_schema()["$defs"]
    assert defs["ModelConfig"]["properties"]["family"]["enum"] == list(FAMILIES)
    assert defs["OptimizerConfig"]["properties"]["kind"]["enum"] == list(OPTIMIZERS)
    assert defs["OptimizerConfig"]["properties"]["schedule"]["enum"] == list(LR_SCHEDULES)
    assert defs["ParallelConfig"]["properties"]["schedule"]["enum"] == list(SCHEDULES)


def test_a_registry_whose_keys_are_not_the_names_is_refused():
    assert registry(("a", "b"), {"a": 1, "b": 2}, "test") == {"a": 1, "b": 2}
    for wrong in ({"a": 1}, {"b": 2, "a": 1}, {"a": 1, "b": 2, "c": 3}):
        with pytest.raises(RuntimeError, match=r"test registers .* and trainyard.parallel.names lists \['a', 'b'\]"):
            registry(("a", "b"), wrong, "test")
