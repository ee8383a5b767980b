"""Make the small Hugging Face ``tokenizer.json`` shipped in ``tests/assets/hf_tokenizer``.

A byte-level BPE trained with the ``tokenizers`` library on the test corpus, with Qwen-style
special tokens (``<|endoftext|>`` as EOS, no BOS, ``<|im_start|>``/``<|im_end|>`` for chat) and a
``tokenizer_config.json`` holding a ChatML chat template of our own, so tests exercise the same
file layout as a hub model folder without a download::

    python scripts/make_hf_tokenizer.py tests/assets/test_corpus/train.jsonl \\
        --vocab-size 1024 --output tests/assets/hf_tokenizer

The vocabulary size counts the special tokens. Training is deterministic for a given corpus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML: every message is "<|im_start|>{role}\n{content}<|im_end|>\n"; a generation prompt
# opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def texts(path: Path, field: str = "text"):
    with path.open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)[field]


def build(corpus: Path, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(corpus), trainer=trainer)
    return tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("corpus", type=Path, help="a .jsonl file with a 'text' field")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--output", type=Path, default=Path("tests/assets/hf_tokenizer"))
    a = p.parse_args(argv)
    tok = build(a.corpus, a.vocab_size)
    a.output.mkdir(parents=True, exist_ok=True)
    tok.save(str(a.output / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (a.output / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {a.output} ({tok.get_vocab_size()} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
