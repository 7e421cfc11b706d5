"""The built-in chat-template renderer against transformers' own (`render_jinja_template`, what
`apply_chat_template` calls): byte-equal text and equal `{% generation %}` spans on the templates of the
families trainyard loads (written here in the form their tokenizer_config.json carries; nothing downloaded),
and the same tokens and loss masks from `encode_record` either way. What the built-in renderer cannot render
is a ChatError saying so."""

from __future__ import annotations

import pytest
from data_helpers import bpe_tokenizer, chat_template
from tokenizers import Tokenizer
from trainyard.parallel.data.chat import ChatError, ChatTemplate, encode_record

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
QWEN2 = (
    "{%- for message in messages %}\n    {%- if loop.first and message['role'] != 'system' %}\n        "
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n    "
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
GENERATION = (  # a ChatML template that marks the assistant's text itself, as SmolLM3's and OLMo's do
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == "
    "'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NAMESPACED = (  # namespace, tojson's options, dict and loop controls, as tool-calling templates use them
    "{%- set ns = namespace(system='') %}{%- for m in messages %}{%- if m.role == 'system' %}"
    "{%- set ns.system = m.content %}{%- continue %}{%- endif %}{{ '<' + m.role + '>' + m.content }}"
    "{%- if m.meta is defined %}{{ m.meta | tojson(indent=2, sort_keys=True) }}{% endif %}{%- endfor %}"
    "{{ '[' + ns.system + ']' }}{{ dict(a=1) | tojson }}")
TEMPLATES = {"llama3": LLAMA3, "qwen2": QWEN2, "mistral": MISTRAL, "generation": GENERATION,
             "namespaced": NAMESPACED, "examples": chat_template()}
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}
CONVERSATIONS = [
    [{"role": "user", "content": "How many cars? "}, {"role": "assistant", "content": " Twelve, all blue."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello ü."},
     {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Hello again."}],
]
SYSTEM = [{"role": "system", "content": "Be brief.", "meta": {"b": [1, 2], "a": "é"}}, *CONVERSATIONS[0]]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("chat-tok"))


def _renderers(source: str) -> tuple[ChatTemplate, ChatTemplate]:
    return (ChatTemplate(source, SPECIAL, renderer="builtin"), ChatTemplate(source, SPECIAL, renderer="transformers"))


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_the_built_in_renderer_is_byte_equal_to_transformers(name, generation_prompt):
    ours, theirs = _renderers(TEMPLATES[name])
    conversations = [*CONVERSATIONS, *([SYSTEM] if name in ("llama3", "qwen2", "namespaced") else [])]
    for messages in conversations:
        for upto in range(1, len(messages) + 1):
            got, want = (r.render_spans(messages[:upto], generation_prompt) for r in (ours, theirs))
            assert got == want
    if name == "generation":  # the spans are the assistant's messages and their end tokens
        text, spans = ours.render_spans(CONVERSATIONS[1], False)
        assert [text[a:b] for a, b in spans] == ["Hello ü.<|im_end|>", "Hello again.<|im_end|>"]


@pytest.mark.parametrize("name", ["llama3", "qwen2", "mistral", "generation"])
def test_prepare_gives_the_same_tokens_and_masks_with_either_renderer(tokenizer, name):
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    ours, theirs = _renderers(TEMPLATES[name])
    for messages in CONVERSATIONS:
        ids, mask = encode_record(tok, ours, {"messages": messages})
        assert (ids, mask) == encode_record(tok, theirs, {"messages": messages})
        counted = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert messages[-1]["content"].strip() in counted and "How many" not in counted and "Again" not in counted


def test_what_a_template_refuses_or_cannot_render_is_a_chat_error():
    ours, _ = _renderers(MISTRAL)
    with pytest.raises(ChatError, match="roles must alternate"):
        ours.render([{"role": "assistant", "content": "first"}], False)
    with pytest.raises(ChatError, match="does not compile"):
        ChatTemplate("{% generation %}never closed", SPECIAL, renderer="builtin").render([], False)
    with pytest.raises(ChatError, match="a namespace"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", SPECIAL, renderer="builtin").render([], False)
