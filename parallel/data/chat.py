"""Fine-tuning records to tokens and a loss mask: chat messages through the tokenizer's chat template, or a
prompt and its completion.

- `{"messages": [{"role", "content"}, ...]}` is rendered with the `chat_template` of the tokenizer's
  tokenizer_config.json: by transformers' own renderer (`render_jinja_template`, what `apply_chat_template`
  calls) when transformers is installed, else by the built-in one, a sandboxed jinja2 environment set up as
  transformers sets up its own (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
  `dict`, `namespace`, its `tojson`, the `{% generation %}` tag, the special tokens as variables); the two
  are tested byte-equal on the templates of the families trainyard loads (tests/unit/test_chat_templates.py).
  The loss counts the assistant's text: the `{% generation %}` spans where the template has them (as
  `return_assistant_tokens_mask` does), else the text each assistant message adds: rendering the conversation
  up to that message with `add_generation_prompt=True` gives where its text starts, rendering it with the
  message included where it ends (this works with any template whose rendering of a conversation starts with
  its rendering of every earlier prefix; another is refused, saying so). A token is counted when its
  characters overlap an assistant span.
- `{"prompt", "completion"}`: the two are tokenized apart (no merge across the boundary, as TRL does);
  the completion's tokens are counted.

The EOS id that `parallel.data.prepare` puts after each record is counted when the record's last token is (so
the model learns to stop after an answer).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np


class ChatError(ValueError):
    """A record or template that cannot be turned into tokens; the message says which and why."""


Renderer = Literal["auto", "builtin", "transformers"]


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]
    """bos_token, eos_token, ... from tokenizer_config.json: templates refer to them by these names."""
    renderer: Renderer = "auto"
    """auto: transformers' when it is installed, else the built-in one."""

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's text itself (`{% generation %}`)."""
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.render_spans(messages, add_generation_prompt)[0]

    def render_spans(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """The text, and the (start, end) character spans of its `{% generation %}` blocks."""
        from jinja2.exceptions import TemplateError

        try:
            if self._uses_transformers():
                from transformers.utils.chat_template_utils import render_jinja_template

                texts, spans = render_jinja_template(
                    conversations=[messages], chat_template=self.source, add_generation_prompt=add_generation_prompt,
                    return_assistant_tokens_mask=self.marks_generation, **self.special_tokens)
                return texts[0], [tuple(span) for span in (spans[0] if spans else [])]
            template, pieces, spans = _compiled(self.source), list[str](), list[tuple[int, int]]()
            with template.environment.tracking(pieces, spans):
                for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                               **self.special_tokens):
                    pieces.append(piece)
            return "".join(pieces), spans
        except ChatError:
            raise
        except (TemplateError, TypeError, ValueError) as e:  # e.g. a content that is not a string
            raise ChatError(f"the chat template cannot render the messages: {type(e).__name__}: {e}") from None

    def _uses_transformers(self) -> bool:
        if self.renderer == "auto":
            return importlib.util.find_spec("transformers") is not None
        return self.renderer == "transformers"


def template_from_config(config: dict | None) -> ChatTemplate | None:
    """The chat template of a tokenizer_config.json (None when it has none)."""
    if not config or not config.get("chat_template"):
        return None
    source = config["chat_template"]
    if isinstance(source, list):  # several named templates: Hugging Face uses "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
        if not source:
            return None
    special = {}
    for key, value in config.items():
        if key.endswith("_token") and value is not None:
            special[key] = value["content"] if isinstance(value, dict) else str(value)
    return ChatTemplate(source=source, special_tokens=special)


_COMPILED: dict[str, Any] = {}


def _compiled(source: str) -> Any:
    if source not in _COMPILED:
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from trainyard.parallel.data.chat_jinja import GenerationSpans, template_globals

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationSpans, loopcontrols])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals.update(template_globals(ChatError))
        try:
            _COMPILED[source] = env.from_string(source)
        except TemplateError as e:
            raise ChatError(f"the chat template does not compile: {e}") from None
    return _COMPILED[source]


def encode_record(tokenizer: Any, template: ChatTemplate | None, record: Any) -> tuple[list[int], list[int]]:
    """(token ids, mask) of one fine-tuning record; mask[i] = 1 where token i is counted in the loss."""
    if isinstance(record, dict) and "messages" in record:
        return _encode_messages(tokenizer, template, record["messages"])
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ChatError("prompt and completion must be strings")
        p = tokenizer.encode(prompt, add_special_tokens=False).ids
        c = tokenizer.encode(completion, add_special_tokens=False).ids
        return p + c, [0] * len(p) + [1] * len(c)
    raise ChatError('a chat record is {"messages": [{"role", "content"}, ...]} or {"prompt", "completion"}')


def _encode_messages(tokenizer: Any, template: ChatTemplate | None, messages: Any) -> tuple[list[int], list[int]]:
    if template is None:
        raise ChatError("messages need a chat template, and the tokenizer has none (tokenizer_config.json has "
                        "no `chat_template`); use prompt/completion records or a tokenizer with a template")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and "content" in m for m in messages):
        raise ChatError("messages must be a list of {role, content} (role a string)")
    text, spans = template.render_spans(messages, add_generation_prompt=False)
    if template.marks_generation:
        return _tokens_and_mask(tokenizer, text, spans)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ChatError(f"the chat template's rendering of messages[:{i + 1}] is not a prefix of the whole "
                            "conversation's, so the assistant's tokens cannot be told apart")
        spans.append((len(before), len(through)))
    return _tokens_and_mask(tokenizer, text, spans)


def _tokens_and_mask(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The text's tokens, and 1 where a token's characters overlap a span."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([s for s, _ in enc.offsets], dtype=np.int64)
    ends = np.array([e for _, e in enc.offsets], dtype=np.int64)
    mask = np.zeros(len(enc.ids), dtype=np.uint8)
    for a, b in spans:
        mask |= ((starts < b) & (ends > a)).astype(np.uint8)
    return list(enc.ids), mask.tolist()
