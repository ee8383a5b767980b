"""Chat SFT data: templates, prompt masking, packing/padding, sharding, resume, preflight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchtitan.config.errors import ConfigError
from torchtitan.data.chat_data import ChatDataset, tokenized_conversations
from torchtitan.data.chat_template import read_conversations, tokenize_conversation
from torchtitan.data.tokenizer import Tokenizer, build_tokenizer
from torchtitan.loss.cross_entropy import IGNORE_INDEX
from torchtitan.preflight.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "tests" / "assets" / "chat" / "train.jsonl"
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "2 plus 2 is 4."},
    {"role": "user", "content": "And 3 plus 3?"},
    {"role": "assistant", "content": "6."},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer("tests/assets/tokenizer")


def _trained_text(tok: Tokenizer, ids: list[int], train: list[bool]) -> str:
    return tok.decode([i for i, t in zip(ids, train) if t])


def test_default_template_trains_only_assistant_content_and_eos(tok: Tokenizer) -> None:
    ids, train = tokenize_conversation(tok, CONV, None)
    eos = "<|end_of_text|>"
    assert tok.decode(ids) == (
        f"<|begin_of_text|><|system|>\nBe brief.{eos}<|user|>\nWhat is 2 plus 2?{eos}"
        f"<|assistant|>\n2 plus 2 is 4.{eos}<|user|>\nAnd 3 plus 3?{eos}<|assistant|>\n6.{eos}"
    )
    assert _trained_text(tok, ids, train) == f"2 plus 2 is 4.{eos}6.{eos}"
    assert ids[0] == tok.bos_id and not train[0]


LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|reserved_special_token_0|>{{ m['role'] }}"
    "<|reserved_special_token_1|>\n\n{{ m['content'] }}<|reserved_special_token_2|>{% endfor %}"
    "{% if add_generation_prompt %}<|reserved_special_token_0|>assistant"
    "<|reserved_special_token_1|>\n\n{% endif %}"
)


def test_tokenizer_chat_template_is_used_and_masked(tok: Tokenizer) -> None:
    tok2 = build_tokenizer("tests/assets/tokenizer")
    tok2.chat_template = LLAMA_LIKE  # type: ignore[attr-defined]
    ids, train = tokenize_conversation(tok2, CONV, LLAMA_LIKE)
    eot = "<|reserved_special_token_2|>"
    assert ids[0] == tok.bos_id  # the template's bos_token string became the BOS id
    assert tok.special_tokens[eot] in ids
    assert _trained_text(tok, ids, train) == f"2 plus 2 is 4.{eot}6.{eot}"
    # the datasets resolve the template through the tokenizer (chat_template = "auto")
    convs, _ = tokenized_conversations(TRAIN, tok2, 512, "truncate", "auto")
    first = convs[0][0]
    assert tok.special_tokens["<|reserved_special_token_0|>"] in first.tolist()
    with pytest.raises(ValueError, match="no chat_template"):
        tokenized_conversations(TRAIN, tok, 512, "truncate", "tokenizer")


def test_unstable_template_is_refused(tok: Tokenizer) -> None:
    bad = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="prefix"):
        tokenize_conversation(tok, CONV, bad)


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", "bad.jsonl:2: not valid JSON"),
        (json.dumps({"text": "hi"}), 'bad.jsonl:2: expected an object with a "messages" list'),
        (
            json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
            "bad.jsonl:2: message 0 has unknown role 'bot'",
        ),
        (json.dumps({"messages": [{"role": "user"}]}), 'string "content"'),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "no assistant message"),
    ],
)
def test_malformed_records_name_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONV}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match) as e:
        list(read_conversations(path))
    assert str(path) in str(e.value)


def _rows(ds: ChatDataset, n: int) -> list[tuple[torch.Tensor, ...]]:
    it = iter(ds)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_rows_hold_every_conversation_with_masked_labels(tok: Tokenizer, packing: str) -> None:
    ds = ChatDataset(TRAIN, tok, 256, packing=packing, with_doc_ids=True)  # type: ignore[arg-type]
    convs, dropped = tokenized_conversations(TRAIN, tok, 256, "truncate")
    assert dropped == 0 and len(convs) == 400
    rows = _rows(ds, len(ds))
    got_labels = torch.cat([lab[lab != IGNORE_INDEX] for _, lab, _ in rows])
    want = torch.cat([torch.from_numpy(lab[lab != IGNORE_INDEX]) for _, lab in convs])
    assert torch.equal(got_labels, want)  # every trained token once, in order
    if packing == "pad":
        assert len(ds) == 400
    else:
        assert len(ds) < 200  # several conversations per row
        assert max(int(d.max()) for *_, d in rows) >= 2
    for inputs, labels, doc_ids in rows:
        assert inputs.shape == labels.shape == doc_ids.shape == (256,)
        # labels are the next inputs inside a conversation
        same = (doc_ids[:-1] == doc_ids[1:]) & (labels[:-1] != IGNORE_INDEX)
        assert torch.equal(labels[:-1][same], inputs[1:][same])
        # every conversation starts with BOS, whose own label (the first header token) is masked
        starts = torch.nonzero(torch.diff(doc_ids, prepend=doc_ids[:1] - 1)).flatten()
        for s in starts[:-1].tolist():
            if labels[s:].ne(IGNORE_INDEX).any():
                assert inputs[s] == tok.bos_id and labels[s] == IGNORE_INDEX


def test_data_parallel_shards_interleave_and_resume_is_exact(tok: Tokenizer) -> None:
    one = _rows(ChatDataset(TRAIN, tok, 64), 8)
    r0 = ChatDataset(TRAIN, tok, 64, dp_rank=0, dp_world_size=2)
    r1 = ChatDataset(TRAIN, tok, 64, dp_rank=1, dp_world_size=2)
    got0, got1 = _rows(r0, 4), _rows(r1, 4)
    for i in range(4):
        assert torch.equal(one[2 * i][1], got0[i][1]) and torch.equal(one[2 * i + 1][1], got1[i][1])
    state = r0.state_dict()
    assert state == {"next_row": 8}
    # the state is a global round boundary: resuming at dp 1 continues with global row 8
    resumed = ChatDataset(TRAIN, tok, 64)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))[0], _rows(ChatDataset(TRAIN, tok, 64), 9)[8][0])
    # a fresh iter() without a loaded state starts again at row 0
    assert torch.equal(next(iter(resumed))[0], one[0][0])


def test_overlong_policies(tok: Tokenizer, tmp_path: Path) -> None:
    assert len(tokenize_conversation(tok, CONV, None)[0]) < 100
    long = [{"role": "user", "content": "hi " * 10}, {"role": "assistant", "content": "ok " * 150}]
    prompt_only = [{"role": "user", "content": "hi " * 150}, {"role": "assistant", "content": "x"}]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"messages": m}) for m in (CONV, long, prompt_only)))
    kept, dropped = tokenized_conversations(path, tok, 100, "truncate")
    assert len(kept) == 2 and dropped == 1  # prompt_only has no trained token left
    assert len(kept[1][0]) == 100
    kept, dropped = tokenized_conversations(path, tok, 100, "drop")
    assert len(kept) == 1 and dropped == 2
    with pytest.raises(ValueError, match=r"c.jsonl:2: conversation of \d+ tokens"):
        tokenized_conversations(path, tok, 100, "error")


def _load(*args: str) -> None:
    load_config(["--training.dataset", "chat", *args], world_size=1)


def test_preflight(tmp_path: Path) -> None:
    _load("--training.dataset_path", str(TRAIN))  # the shipped set is valid
    with pytest.raises(ConfigError, match="training.dataset_path: a 'chat' dataset needs a file"):
        _load()
    with pytest.raises(ConfigError, match="does not exist"):
        _load("--training.dataset_path", str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONV}) + "\n" + '{"messages": [{"role": "robot"')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        _load("--training.dataset_path", str(bad))
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: message 0 has unknown role 'robot'"):
        _load("--training.dataset_path", str(bad))
    with pytest.raises(ConfigError, match=r"train.jsonl:\d+: conversation of \d+ tokens"):
        _load("--training.dataset_path", str(TRAIN), "--training.seq_len", "32",
              "--sft.overlong", "error")  # fmt: skip
    with pytest.raises(ConfigError, match="validation.dataset_path"):
        _load("--training.dataset_path", str(TRAIN), "--validation.enable",
              "--validation.dataset", "chat")  # fmt: skip
    with pytest.raises(ConfigError, match="is a directory"):
        _load("--training.dataset_path", str(tmp_path))
    with pytest.raises(ConfigError, match="training.data_sharding = 'document'"):
        _load("--training.dataset_path", str(TRAIN), "--training.data_sharding", "document")
    with pytest.raises(ConfigError, match="sft.packing = 'pad': applies only to a 'chat'"):
        load_config(["--sft.packing", "pad"], world_size=1)
    with pytest.raises(ConfigError, match="no chat_template"):
        _load("--training.dataset_path", str(TRAIN), "--sft.chat_template", "tokenizer")
