"""Preference pairs and the reference (docs/posttrain.md): JSONL and a saved Hugging Face dataset
give the same rows, only completion tokens are labelled, bad records are DataErrors naming the
file and record (empty side, a prompt with no room for a completion); the LoRA reference (adapters
off) is the base exactly, and the frozen-shard reference swaps in and back out bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.posttrain_helpers import CharTokenizer, tiny_model
from torchtitan.config.job_config import Lora
from torchtitan.data.checks import DataError
from torchtitan.lora.apply import apply_lora, init_adapters
from torchtitan.loss.cross_entropy import IGNORE_INDEX
from torchtitan.posttrain.preference_data import PreferenceDataset
from torchtitan.posttrain.reference import Reference

PAIR = {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "five"}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_label_only_the_completion(tmp_path: Path) -> None:
    ds = PreferenceDataset(_write(tmp_path / "p.jsonl", [PAIR]), CharTokenizer(), 48)
    c_in, c_lab, r_in, r_lab = ds.row(0)
    tok = CharTokenizer()
    assert tok.decode(c_lab[c_lab != IGNORE_INDEX].tolist()) == "4"  # then EOS (id 0, dropped)
    assert tok.decode(r_lab[r_lab != IGNORE_INDEX].tolist()) == "five"
    assert int((c_lab != IGNORE_INDEX).sum()) == 2 and int((r_lab != IGNORE_INDEX).sum()) == 5
    n = int((c_lab == IGNORE_INDEX).long().argmin())  # first labelled position: prompt identical
    assert torch.equal(c_in[: n + 1], r_in[: n + 1])


def test_hf_dataset_equals_jsonl(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [PAIR, {"prompt": "3+3?", "chosen": "6", "rejected": "7"}]
    a = PreferenceDataset(_write(tmp_path / "p.jsonl", rows), CharTokenizer(), 48)
    datasets.Dataset.from_list(rows[1:]).save_to_disk(str(tmp_path / "hf"))
    b = PreferenceDataset(tmp_path / "hf", CharTokenizer(), 48)
    assert all(torch.equal(x, y) for x, y in zip(a.row(1), b.row(0), strict=True))


@pytest.mark.parametrize(
    "record,seq_len,rule",
    [
        ({**PAIR, "chosen": ""}, 48, "the chosen side is empty"),
        (
            {**PAIR, "rejected": [{"role": "assistant", "content": "  "}]},
            48,
            "the rejected side is empty",
        ),
        ({**PAIR, "prompt": "x" * 60}, 48, r"the prompt is \d+ tokens, leaving no room"),
        ({**PAIR, "prompt": "x" * 10}, 30, "the prompt leaves no room for the chosen completion"),
        (
            {"prompt": "a", "chosen": "b"},
            48,
            'expected an object with "prompt", "chosen" and "rejected"',
        ),
    ],
)
def test_bad_records_are_refused(tmp_path: Path, record: dict, seq_len: int, rule: str) -> None:
    path = _write(tmp_path / "p.jsonl", [PAIR, record])
    with pytest.raises(DataError, match=rf"p.jsonl, line 2: preference record: {rule}") as e:
        PreferenceDataset(path, CharTokenizer(), seq_len)
    assert e.value.field == "dpo.dataset_path"


def test_lora_reference_is_the_base_and_frozen_swap_is_exact() -> None:
    x = torch.randint(1, 256, (2, 10))
    base = tiny_model(0)
    want = base(x).detach()
    model = tiny_model(0)
    apply_lora(model, Lora(enable=True, rank=4, target_modules=["attention.w*", "feed_forward.w*"]))
    init_adapters(model, 0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p)  # adapters that change the output
    ref = Reference([model])
    assert ref.frozen is None and not torch.equal(model(x), want)
    with ref.active():
        assert torch.equal(model(x), want)
    # full fine-tuning: a frozen copy of another model's weights is swapped in and back out
    policy, other = tiny_model(0), tiny_model(5)
    frozen = Reference([policy])
    frozen.load_state_dict(dict(other.state_dict()))
    with frozen.active():
        assert torch.equal(policy(x), other(x))
    assert torch.equal(policy(x), want)
