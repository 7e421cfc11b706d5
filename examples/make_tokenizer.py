"""Train the small byte-level BPE tokenizer in examples/tokenizer/ from the text in examples/.

    .venv/bin/python examples/make_tokenizer.py      # rewrites examples/tokenizer/{tokenizer,tokenizer_config}.json

Byte-level (any UTF-8 text encodes, nothing is unknown), 1024 ids, trained on examples/corpus.txt and the
text of examples/finetune.jsonl; `<|endoftext|>` is the EOS token that `trainyard prepare` puts after each
document; `<|system|>`, `<|user|>`, `<|assistant|>` and `<|end|>` are the chat template's markers. The files
load in transformers with `PreTrainedTokenizerFast.from_pretrained("examples/tokenizer")`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 1024
EOS = "<|endoftext|>"
SPECIAL = [EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def texts() -> list[str]:
    out = [(HERE / "corpus.txt").read_text()]
    for line in (HERE / "finetune.jsonl").read_text().splitlines():
        record = json.loads(line)
        out += [m["content"] for m in record.get("messages", [])] + [record.get("prompt", ""),
                                                                     record.get("completion", "")]
    return out


def train(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None, "pad_token": EOS,
            "unk_token": None, "model_max_length": 2048, "chat_template": CHAT_TEMPLATE}


def main() -> None:
    out = HERE / "tokenizer"
    out.mkdir(exist_ok=True)
    tok = train(texts())
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    print(f"{out}: vocabulary {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
