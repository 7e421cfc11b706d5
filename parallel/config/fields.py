"""The JobSpec's shared field types: the bounds every number carries, the integer types that refuse a boolean,
the strictness every section declares, and the error a rule between fields raises.

Part of the JobSpec (`parallel.config` re-exports every name). Imports no pydantic: pydantic reads the
`Annotated` constraints and calls `NOT_BOOL`'s hook when it builds its validator, so a rank imports this with
torch alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from annotated_types import Ge, Gt, Le


class _NotBool:
    """The last item of a number's `Annotated`: the field refuses a boolean, which pydantic's lax mode reads as 1 or
    0 (`steps: true` was one step, `parallel.zero: true` ZeRO-1; YAML 1.1's yes, no, on, off are booleans too). A
    number written as a string stays a number: PyYAML reads `lr: 3e-4` and `1e3` as strings. pydantic calls the hook
    as it builds its validator, so this module imports no pydantic (a rank imports it with torch alone). Last,
    because bounds after it would wrap a validator function, which drops them from the JSON schema."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Callable[[Any], Any]) -> Any:
        from pydantic_core import PydanticCustomError, core_schema

        kind, what = ("float_type", "a valid number") if source is float else ("int_type", "a valid integer")

        def refuse_bool(value: object) -> object:
            if isinstance(value, bool):
                raise PydanticCustomError(kind, f"Input should be {what}, not a boolean")
            return value

        return core_schema.no_info_before_validator_function(refuse_bool, handler(source))


NOT_BOOL = _NotBool()


class _ConfigJson:
    """The last item of a string field that holds a config.json (`model.hf_config`): the string must be a JSON object
    with a string `model_type` (transformers' name of the architecture), checked as the spec is read, so a broken
    one is a 422 naming the field rather than an error wherever it is first parsed. The string itself is kept."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Callable[[Any], Any]) -> Any:
        import json

        from pydantic_core import PydanticCustomError, core_schema

        def parsed(value: str) -> str:
            try:
                fields = json.loads(value)
            except ValueError as e:
                raise PydanticCustomError("value_error", "is not JSON: {error}", {"error": str(e)}) from None
            if not isinstance(fields, dict):
                raise PydanticCustomError("value_error", "is JSON but not an object (a config.json's fields)")
            if not isinstance(fields.get("model_type"), str):
                raise PydanticCustomError("value_error", "has no model_type (the string naming the architecture "
                                                         "transformers builds)")
            return value

        return core_schema.no_info_after_validator_function(parsed, handler(source))


CONFIG_JSON = _ConfigJson()

# Every number a spec carries is bounded: integers so that sums and products of them stay far inside int64
# (the store's INTEGER and torch's index type) and every loop a plan runs stays small, floats finite (JSON
# has no Infinity or NaN). A bound here is generous; the plan's rules (cluster fit, memory) are the real limits.
MAX_STEPS = 10**9
"""More steps than any job runs; also bounds warm-up and checkpoint intervals."""
MAX_DEGREE = 2**16
"""Any one parallel degree, and the number of workers of a job."""
MAX_GLOBAL_BATCH = 2**24
MAX_SEQ_LEN = 2**20
MAX_PRIORITY = 10**6

Degree = Annotated[int, Gt(0), Le(MAX_DEGREE), NOT_BOOL]
Steps = Annotated[int, Ge(0), Le(MAX_STEPS), NOT_BOOL]
# an unknown field is an error, never silently ignored; inf and nan are refused like any other bad value. (The
# docstring under each field is docs/jobspec.md's description, read by docs/jobspec.py; pydantic's
# use_attribute_docstrings would put it in /openapi.json too, but building the adapter, at every CLI, service and
# coordinator start, then took 0.6-2.7 s instead of 0.14-0.29 s, measured on a shared 2-core machine.)
STRICT = {"extra": "forbid", "allow_inf_nan": False}


class RuleError(ValueError):
    """A JobSpec that breaks a rule. `field` is the dotted path of the field to change."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)  # both in args, so the error pickles across Ray processes
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class NotNative(RuleError):
    """A config.json field that changes what the model computes and that the family does not implement: a reason
    not to claim the directory, never to train it otherwise. The transformers backend (`model.family: hf`) takes
    it where it trains the architecture exactly (`parallel.io.hf_spec.model_fields`); without transformers it is the
    submit's 422. A garbled field (a string for a number) stays a plain RuleError: no family reads it."""
