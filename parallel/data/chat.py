"""Fine-tuning records to tokens and a loss mask: chat messages through the tokenizer's chat template, or a
prompt and its completion.

- `{"messages": [{"role", "content"}, ...]}` is rendered with the `chat_template` of the tokenizer's
  tokenizer_config.json, in a sandboxed jinja2 environment set up as Hugging Face's `apply_chat_template`
  sets it up (trim_blocks, lstrip_blocks, `raise_exception`, the special tokens as variables). The loss
  counts the text each assistant message adds: rendering the conversation up to that message with
  `add_generation_prompt=True` gives where its text starts, rendering it with the message included where
  it ends (Hugging Face's own `{% generation %}` markers exist in few templates; this works with any
  template whose rendering of a conversation starts with its rendering of every earlier prefix). A token
  is counted when its characters overlap an assistant span.
- `{"prompt", "completion"}`: the two are tokenized apart (no merge across the boundary, as TRL does);
  the completion's tokens are counted.

The EOS id that `parallel.data.prepare` puts after each record is counted when the record's last token is (so
the model learns to stop after an answer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np


class ChatError(ValueError):
    """A record or template that cannot be turned into tokens; the message says which and why."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]
    """bos_token, eos_token, ... from tokenizer_config.json: templates refer to them by these names."""

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return _compiled(self.source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **self.special_tokens)
        except (TemplateError, TypeError) as e:  # e.g. a content that is not a string
            raise ChatError(f"the chat template cannot render the messages: {type(e).__name__}: {e}") from None


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

        def raise_exception(message: str) -> None:
            raise ChatError(f"the chat template refused the record: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
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
    text = template.render(messages, add_generation_prompt=False)
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
    enc = tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([s for s, _ in enc.offsets], dtype=np.int64)
    ends = np.array([e for _, e in enc.offsets], dtype=np.int64)
    mask = np.zeros(len(enc.ids), dtype=np.uint8)
    for a, b in spans:
        mask |= ((starts < b) & (ends > a)).astype(np.uint8)
    return list(enc.ids), mask.tolist()
