"""The JobSpec read and written: YAML or JSON into the frozen `parallel.config.JobConfig` with readable errors,
and back to plain data. One pydantic adapter serves every reader: the API's bodies, the CLI's files, the
service's store and the coordinator's checkpoint manifests, so each reports a broken field the same way (its
dotted path and the rule it breaks). What a submit adds (`init_from`'s architecture) is the API's
(`api.spec`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError
from trainyard.parallel.config import JobConfig

SPEC_ADAPTER = TypeAdapter(JobConfig)


class SpecError(ValueError):
    """An invalid JobSpec; `errors` are (dotted field, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        super().__init__("; ".join(f"{f}: {m}" for f, m in errors))
        self.errors = errors


_UNION_MEMBERS = {"constrained-int", "int", "DpRange", "ParallelConfig",
                  "function-before[refuse_bool(), constrained-int]"}
"""The names pydantic puts into an error's location for the member of a union it tried (`parallel.dp` is a
number or {min, max}; the last, a bounded integer that refuses booleans, `parallel.config.NOT_BOOL`): not fields, so
left out of the dotted path."""


_AUTO = "literal['auto']"
"""The other member of `parallel` (a layout or `auto`): a mapping that fails as a layout also fails as `auto`,
which says nothing the layout's own errors do not."""


def relevant_errors(errors: Sequence[Any]) -> list[Any]:
    """The errors to report: those of `parallel`'s `auto` member only when nothing else went wrong."""
    others = [e for e in errors if _AUTO not in map(str, e["loc"])]
    return others or list(errors)


def describe_error(error: dict) -> tuple[str, str]:
    """(dotted field, message) from one pydantic error, with unknown fields said plainly."""
    if error["type"] == "rule":  # a RuleError raised while the spec was read (see `SubmittedSpec`)
        return error["ctx"]["field"], error["ctx"]["message"]
    loc = [str(p) for p in error["loc"] if p != "body" and p not in _UNION_MEMBERS and p != _AUTO]
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return ".".join(loc), f"unknown field '{loc[-1]}'"
    if error["type"] == "json_invalid":  # FastAPI's: the location is ("body", character offset)
        return "body", f"cannot read the body as JSON at character {loc[-1]}: {error['ctx']['error']}"
    return ".".join(loc), error["msg"]


def parse_spec(obj: Any) -> JobConfig:
    try:
        return SPEC_ADAPTER.validate_python(obj)
    except ValidationError as e:
        raise SpecError([describe_error(err) for err in relevant_errors(e.errors())]) from None


def spec_to_dict(config: JobConfig) -> dict:
    """The JobSpec as plain JSON data, with fields under the names a spec uses (`checkpoint.async`)."""
    return SPEC_ADAPTER.dump_python(config, mode="json")


def load_spec_text(text: str) -> dict:
    """YAML (a superset of JSON) to a dict; a file that is not a mapping is an error."""
    try:
        obj = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError([("", f"not valid YAML/JSON: {e}")]) from None
    except ValueError as e:  # a scalar PyYAML cannot build: a date like 2001-02-30, an int of over 4300 digits
        raise SpecError([("", f"not valid YAML/JSON: {e}")]) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise SpecError([("", "not valid YAML/JSON: lists or mappings nested too deeply")]) from None
    if not isinstance(obj, dict):
        raise SpecError([("", "a JobSpec must be a mapping of fields")])
    return obj
