"""Hugging Face ``tokenizer.json`` tokenizers (Qwen3 and most hub models), through the
``tokenizers`` library.

``build_tokenizer`` (``data/tokenizer.py``) picks this class when it finds a
``tokenizer.json`` (the file itself, or a directory holding one and no ``tokenizer.model``).
The interface is the tiktoken ``Tokenizer``'s: ``vocab_size``, ``bos_id``, ``eos_id``,
``encode(text, bos, eos)``, ``encode_batch``, ``decode``.

BOS and EOS come from ``tokenizer_config.json`` beside the file (``bos_token`` / ``eos_token``,
a string or ``{"content": ...}``) when it exists; otherwise EOS is the first of the usual names
found among the special tokens. A tokenizer without a BOS (Qwen3's ``bos_token`` is null) adds
nothing for ``bos=True``. The Jinja ``chat_template`` of ``tokenizer_config.json``, if any, is
exposed as :attr:`HFTokenizer.chat_template` for chat formatting.

Special-token strings inside ordinary text are encoded as text, never as special ids (the
``encode_special_tokens`` switch), so a document cannot forge an EOS, as with tiktoken.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["HF_TOKENIZER_FILENAME", "HFTokenizer"]

HF_TOKENIZER_FILENAME = "tokenizer.json"
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A ``tokenizer.json`` file with its optional ``tokenizer_config.json``."""

    def __init__(self, path: str | Path) -> None:
        self.model_path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.model_path))
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise ValueError(
                f"{self.model_path} is not a Hugging Face tokenizer.json ({e}). Make a test one "
                "with `python scripts/make_hf_tokenizer.py` or point model.tokenizer_path at a "
                "model's tokenizer folder."
            ) from e
        config_path = self.model_path.parent / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        self.chat_template: str | None = config.get("chat_template")
        """The model's Jinja chat template, or None when the folder has none."""
        self.bos_token = _token_name(config.get("bos_token"))
        eos = _token_name(config.get("eos_token"))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if eos is None:
            eos = next((name for name in _EOS_NAMES if name in vocab), None)
        if eos is None or eos not in vocab:
            raise ValueError(
                f"{self.model_path}: no EOS token (eos_token={eos!r} in tokenizer_config.json, "
                f"or one of {', '.join(_EOS_NAMES)} in the vocabulary); documents need one"
            )
        if self.bos_token is not None and self.bos_token not in vocab:
            raise ValueError(f"{self.model_path}: bos_token {self.bos_token!r} is not a token")
        self.eos_token = eos
        # Special-token strings in the text are encoded as text (see the module docstring).
        self._tok.encode_special_tokens = True
        self.special_tokens = {
            t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    @property
    def vocab_size(self) -> int:
        """Every token id the file defines (added tokens included): the embedding size."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def _id(self, token: str) -> int:
        found = self._tok.token_to_id(token)
        assert found is not None, token  # checked in __init__
        return int(found)

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self._id(self.bos_token)

    @property
    def eos_id(self) -> int:
        return self._id(self.eos_token)

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        prefix = [self.bos_id] if bos and self.bos_id is not None else []
        return prefix + ids + ([self.eos_id] if eos else [])

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        """Token ids of ``text`` (no template, no special tokens from the text), with BOS
        (if the tokenizer has one) and/or EOS if asked."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return self._wrap(list(ids), bos, eos)

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list[list[int]]:
        out = self._tok.encode_batch(texts, add_special_tokens=False)
        return [self._wrap(list(e.ids), bos, eos) for e in out]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens written out by name)."""
        tolist = getattr(ids, "tolist", None)
        seq = tolist() if callable(tolist) else list(ids)
        return str(self._tok.decode(seq, skip_special_tokens=False))

    def __repr__(self) -> str:
        return f"HFTokenizer(path={str(self.model_path)!r}, vocab_size={self.vocab_size})"
