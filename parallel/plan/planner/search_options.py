"""The options the automatic planner searches (`parallel: auto`), and how to read and set one on a config.

`SEARCHED` maps a dotted option to the values the search tries: one line per option, read off the config's
Literals and the sharding registry, so a new entry joins the search with no change elsewhere. Every option here
changes the layout only, never the training's numbers. Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import replace

from trainyard.parallel.config import JobConfig, ParallelConfig
from trainyard.parallel.plan.sharding import SHARDINGS


def _literal_values(owner: type, name: str) -> tuple:
    hints = typing.get_type_hints(owner)
    return tuple(v for arg in [hints[name]] for v in typing.get_args(arg) if not isinstance(v, type))


SEARCHED: dict[str, typing.Callable[[], tuple]] = {
    "parallel.zero": lambda: tuple(z for z in _literal_values(ParallelConfig, "zero") if z in SHARDINGS),
    "activation_checkpointing": lambda: _literal_values(JobConfig, "activation_checkpointing"),
    "optimizer.offload": lambda: (False, True),
    "activation_offload": lambda: (False, True),
    "parallel.activation_offload": lambda: (False, True),
}
"""Dotted option -> the values the search tries (an option the config does not have is skipped): one line
per option. Layout-only options: none changes the training's numbers."""


def searched_paths(config: JobConfig) -> list[str]:
    return [path for path in SEARCHED if _has_field(config, path)]


def searched_values(config: JobConfig) -> dict[str, tuple]:
    """Each option of `SEARCHED` the config has -> the values the search tries (read from this module's
    `SEARCHED` at each call, so one test can narrow the search)."""
    return {path: SEARCHED[path]() for path in searched_paths(config)}


def _has_field(config: JobConfig, path: str) -> bool:
    obj: object = config
    for part in path.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            return False
        obj = getattr(obj, part)
    return True


def with_option(config: JobConfig, path: str, value: object) -> JobConfig:
    head, _, rest = path.partition(".")
    new: typing.Any = with_option(getattr(config, head), rest, value) if rest else value  # any field's type
    return replace(config, **{head: new})
