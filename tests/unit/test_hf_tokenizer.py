"""Hugging Face ``tokenizer.json`` support: chosen by the files found, round-trips text, agrees
with transformers' own loader, takes BOS/EOS and the chat template from tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_loader import load
from torchtitan.data.hf_tokenizer import HFTokenizer
from torchtitan.data.tokenizer import Tokenizer, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ASSET = ROOT / "tests" / "assets" / "hf_tokenizer"
TEXT = "Once upon a time, a café served 1234 naïve crêpes.\n\tTabs and  spaces!"


def test_chosen_by_the_files_found(tmp_path: Path) -> None:
    assert isinstance(build_tokenizer("tests/assets/hf_tokenizer"), HFTokenizer)
    assert isinstance(build_tokenizer(str(ASSET / "tokenizer.json")), HFTokenizer)
    assert isinstance(build_tokenizer("tests/assets/tokenizer"), Tokenizer)  # tiktoken
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.model or tokenizer\.json"):
        build_tokenizer(str(tmp_path))


def test_round_trip_eos_and_no_bos() -> None:
    tok = build_tokenizer(ASSET)
    assert tok.vocab_size == 1024
    assert tok.bos_id is None  # Qwen-style: no BOS, bos=True adds nothing
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert ids[-1] == tok.eos_id == 0 and tok.eos_id not in ids[:-1]
    assert tok.decode(ids[:-1]) == TEXT
    assert tok.encode_batch([TEXT, "x"], bos=False, eos=False) == [
        tok.encode(TEXT, bos=False, eos=False),
        tok.encode("x", bos=False, eos=False),
    ]


def test_special_strings_in_text_are_not_special_ids() -> None:
    tok = build_tokenizer(ASSET)
    ids = tok.encode("a <|endoftext|> b <|im_end|>", bos=False, eos=False)
    assert not set(ids) & set(tok.special_tokens.values()), ids
    assert tok.decode(ids) == "a <|endoftext|> b <|im_end|>"


def test_bos_eos_and_chat_template_from_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((ASSET / "tokenizer.json").read_bytes())
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = build_tokenizer(tmp_path)
    assert tok.chat_template is None
    ids = tok.encode("hi", bos=True, eos=True)
    assert (ids[0], ids[-1]) == (1, 2)  # <|im_start|>, <|im_end|>
    assert "im_start" in (build_tokenizer(ASSET).chat_template or "")
    config["eos_token"] = "<|nope|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no EOS token"):
        build_tokenizer(tmp_path)


def test_same_ids_as_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ASSET / "tokenizer.json"))
    ours = build_tokenizer(ASSET)
    texts = [TEXT] + [json.loads(line)["text"][:500] for line in _lines(5)]
    for text in texts:
        assert ours.encode(text, bos=False, eos=False) == theirs.encode(text), text[:40]


def _lines(n: int) -> list[str]:
    with (ROOT / "tests/assets/test_corpus/validation.jsonl").open() as f:
        return [next(f) for _ in range(n)]


def test_script_makes_a_loadable_tokenizer(tmp_path: Path) -> None:
    mk = load("scripts/make_hf_tokenizer.py", "mk")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ab ab ab abc"] * 50))
    assert mk.main([str(corpus), "--vocab-size", "300", "--output", str(tmp_path / "t")]) == 0
    tok = build_tokenizer(tmp_path / "t")
    assert tok.decode(tok.encode("ab abc", bos=False, eos=False)) == "ab abc"
    assert tok.chat_template == mk.CHAT_TEMPLATE
