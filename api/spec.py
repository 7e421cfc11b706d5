"""A JobSpec as a user submits it (REST bodies and `trainyard submit`/`plan` files): what a submit adds to the
spec (`init_from.hf`'s architecture, read from its config.json) and the rules only a new submit is held to,
then `parallel.spec`'s reading with its readable errors.
"""

from __future__ import annotations

import unicodedata
from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BeforeValidator, PlainValidator, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError
from trainyard.parallel.config import JobConfig, RuleError
from trainyard.parallel.spec import SPEC_ADAPTER, SpecError, parse_spec

__all__ = ["SPEC_ADAPTER", "RawSpec", "SpecError", "SubmittedSpec", "parse_submitted_spec", "resolve_submitted",
           "validate_submitted"]


def parse_submitted_spec(obj: Any) -> JobConfig:
    """A spec as a user submits it: `init_from.hf` fills in the model's architecture from its config.json
    (`parallel.io.hf_spec`), then the spec is validated. A stored spec has it filled in already: `parse_spec`."""
    try:
        resolved = resolve_submitted(obj)
    except RuleError as e:
        raise SpecError([(e.field, e.message)]) from None
    return parse_spec(resolved)


def resolve_submitted(obj: Any) -> Any:
    """The spec with what a submit adds to it (the architecture of `init_from.hf`); raises RuleError. Also the
    rules a new submit keeps and a stored spec is not held to (a job stored before a rule must still load)."""
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and _has_control_character(obj["name"]):
        raise RuleError("name", "has a control character (a new line, an escape sequence), which would print as "
                                "such in `trainyard list`")
    if isinstance(obj, dict) and obj.get("init_from") is not None:
        from trainyard.parallel.io.hf_spec import resolve_init_from  # reads config.json only, no tensor

        return resolve_init_from(obj)
    return obj


def _has_control_character(text: str) -> bool:
    return any(unicodedata.category(c) == "Cc" for c in text)


def _resolve_or_rule_error(obj: Any) -> Any:
    try:
        return resolve_submitted(obj)
    except RuleError as e:
        raise PydanticCustomError("rule", "{field}: {message}", {"field": e.field, "message": e.message}) from None


SubmittedSpec = Annotated[JobConfig, BeforeValidator(_resolve_or_rule_error)]
"""A submit's or a plan's body as a JobConfig, read as `parse_submitted_spec` reads it."""

RawSpec = Annotated[Any, PlainValidator(lambda obj: obj, json_schema_input_type=JobConfig)]
"""The REST body of a submit or a plan as sent (its schema: a JobConfig's): its paths are resolved against the
caller (`Tenancy.confine`) before it is read (`validate_submitted`), since reading it reads `init_from.hf`."""

_SUBMITTED: TypeAdapter[JobConfig] = TypeAdapter(SubmittedSpec)


def validate_submitted(obj: Any) -> JobConfig:
    """A body (its paths confined) as a JobConfig; RequestValidationError, as FastAPI raises for a body, if not."""
    try:
        return _SUBMITTED.validate_python(obj)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
