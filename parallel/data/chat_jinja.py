"""What the built-in chat-template renderer (`parallel.data.chat`) adds to jinja2 so that a template renders as
transformers renders it: the `{% generation %}` tag (whose spans mark the assistant's text) and the globals
transformers gives templates. Written after transformers' `chat_template_utils`, which trainyard does not need
installed; tests/unit/test_chat_templates.py holds the two renderers byte-equal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension


class GenerationSpans(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body and, while `environment.tracking(pieces, spans)`
    is on, records the body's (start, end) in the whole text: its start is the length of the `pieces` the
    caller has collected from `template.generate` so far (as transformers' AssistantTracker does)."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        self._tracking: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("spans", default=None)
        environment.extend(tracking=self.tracking)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

    def _span(self, caller: Callable[[], str]) -> str:
        text = caller()
        if (tracked := self._tracking.get()) is not None:
            pieces, spans = tracked
            start = len("".join(pieces))
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def tracking(self, pieces: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
        token = self._tracking.set((pieces, spans))
        try:
            yield
        finally:
            self._tracking.reset(token)


def template_globals(error: type[Exception]) -> dict[str, Any]:
    """`raise_exception` (raising `error`), `strftime_now`, `dict` and `namespace` as transformers defines them."""

    def raise_exception(message: str) -> None:
        raise error(f"the chat template refused the record: {message}")

    class TemplateDict:  # `dict(...)` and `dict.fromkeys(...)` without the type itself in reach
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore-prefixed attributes
        def __init__(*args: Any, **kwargs: Any):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    return {"raise_exception": raise_exception, "strftime_now": lambda fmt: datetime.now().strftime(fmt),
            "dict": TemplateDict(), "namespace": TemplateNamespace}
