"""Reading a JobSpec (YAML or JSON) into the frozen `parallel.config.JobConfig`, with readable errors.

The same adapter validates REST bodies (FastAPI reads the dataclasses directly) and files given to the
CLI, so both report a broken field the same way: its dotted path and the rule it breaks.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from parallel.config import JobConfig

SPEC_ADAPTER = TypeAdapter(JobConfig)


class SpecError(ValueError):
    """An invalid JobSpec; `errors` are (dotted field, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        super().__init__("; ".join(f"{f}: {m}" for f, m in errors))
        self.errors = errors


_UNION_MEMBERS = {"constrained-int", "int", "DpRange"}
"""The names pydantic puts into an error's location for the member of a union it tried (`parallel.dp` is a
number or {min, max}): not fields, so left out of the dotted path."""


def describe_error(error: dict) -> tuple[str, str]:
    """(dotted field, message) from one pydantic error, with unknown fields said plainly."""
    loc = [str(p) for p in error["loc"] if p != "body" and p not in _UNION_MEMBERS]
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return ".".join(loc), f"unknown field '{loc[-1]}'"
    return ".".join(loc), error["msg"]


def parse_spec(obj: Any) -> JobConfig:
    try:
        return SPEC_ADAPTER.validate_python(obj)
    except ValidationError as e:
        raise SpecError([describe_error(err) for err in e.errors()]) from None


def spec_to_dict(config: JobConfig) -> dict:
    """The JobSpec as plain JSON data, with fields under the names a spec uses (`checkpoint.async`)."""
    return SPEC_ADAPTER.dump_python(config, mode="json")


def load_spec_text(text: str) -> dict:
    """YAML (a superset of JSON) to a dict; a file that is not a mapping is an error."""
    try:
        obj = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError([("", f"not valid YAML/JSON: {e}")]) from None
    if not isinstance(obj, dict):
        raise SpecError([("", "a JobSpec must be a mapping of fields")])
    return obj
