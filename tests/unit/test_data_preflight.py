"""Preflight of the tokenized and mixture options: clear errors before any process group, and
[[training.mixture]] tables in TOML (docs/data.md, docs/config.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.tokenized_helpers import CORPUS, TOKENIZER, make_corpus, split_jsonl
from torchtitan.config import ConfigError, parse_args, to_toml
from torchtitan.config.job_config import MixtureSource
from torchtitan.preflight.validate import load_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("preflight")
    src = split_jsonl(CORPUS / "validation.jsonl", root / "src", parts=1, lines=40)
    return make_corpus(root / "tok", "json", str(src))


def _toml(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "job.toml"
    seq = "" if "seq_len" in body else "seq_len = 64\n"
    path.write_text(f'[model]\ntokenizer_path = "{TOKENIZER}"\n[training]\n{seq}{body}')
    return ["--job.config_file", str(path)]


def test_mixture_tables_parse_and_round_trip(tmp_path: Path, corpus: Path) -> None:
    argv = _toml(
        tmp_path,
        f'dataset = "mixture"\n[[training.mixture]]\npath = "{corpus}"\nweight = 2.0\n'
        f'[[training.mixture]]\npath = "{CORPUS / "validation.jsonl"}"\nweight = 1\n',
    )
    cfg = load_config(argv, world_size=1)
    assert cfg.training.mixture == [
        MixtureSource(path=str(corpus), weight=2.0),
        MixtureSource(path=str(CORPUS / "validation.jsonl"), weight=1.0),
    ]
    (tmp_path / "again.toml").write_text(to_toml(cfg))
    again = parse_args(["--job.config_file", str(tmp_path / "again.toml")])
    assert again.training == cfg.training


def test_tokenized_dataset_validates(tmp_path: Path, corpus: Path) -> None:
    argv = _toml(tmp_path, f'dataset = "tokenized"\ndataset_path = "{corpus}"\n')
    load_config(argv + ["--training.tokenized_shuffle", "documents"], world_size=2)


@pytest.mark.parametrize(
    "body, field, needle",
    [
        ('dataset = "tokenized"\n', "training.dataset_path", "must name the corpus folder"),
        ('dataset = "tokenized"\ndataset_path = "/nonexistent/x"\n', "training.dataset_path",
         "is not a folder"),
        ('dataset = "tokenized"\ndataset_path = "{raw}"\n', "training.dataset_path",
         "has no manifest.json"),
        ('dataset = "tokenized"\ndataset_path = "{other_tok}"\n', "training.dataset_path",
         "another tokenizer"),
        ('dataset = "tokenized"\ndataset_path = "{short}"\n', "training.dataset_path",
         "is damaged"),
        ('dataset = "tokenized"\ndataset_path = "{corpus}"\nseq_len = 100000\n',
         "training.dataset_path", "fewer than one window"),
        ('dataset = "mixture"\n', "training.mixture", "is empty"),
        ('[[training.mixture]]\npath = "{corpus}"\n', "training.dataset", "is not 'mixture'"),
        ('dataset = "mixture"\n[[training.mixture]]\npath = "{corpus}"\nweight = 0.0\n',
         "training.mixture[0].weight", "must be a finite number > 0"),
        ('dataset = "mixture"\n[[training.mixture]]\npath = "{corpus}"\nweight = -1.0\n',
         "training.mixture[0].weight", "> 0"),
        ('dataset = "mixture"\n[[training.mixture]]\nweight = 1.0\n', "training.mixture[0]",
         "names no data"),
        ('dataset = "mixture"\n[[training.mixture]]\npath = "/nonexistent/y"\n',
         "training.mixture[0].path", "does not exist"),
        ('dataset = "mixture"\n[[training.mixture]]\npath = "{corpus}"\n'
         '[[training.mixture]]\npath = "{corpus}"\n', "training.mixture[1]", "same name"),
        ('dataset = "mixture"\n[[training.mixture]]\npath = "{corpus}"\ndataset = "c4"\n',
         "training.mixture[0].dataset", "has no dataset name"),
        ('dataset = "mixture"\ndataset_path = "x"\n[[training.mixture]]\npath = "{corpus}"\n',
         "training.dataset_path", "is not used"),
        ('tokenized_shuffle = "windows"\n', "training.tokenized_shuffle", "only applies"),
        ('mixture_exhausted = "error"\n', "training.mixture_exhausted", "only applies"),
        ('dataset = "tokenized"\ndataset_path = "{corpus}"\ndata_sharding = "document"\n',
         "training.data_sharding", "only applies to text datasets"),
        ('[[training.mixture]]\npathh = "x"\n', "training.mixture[0].pathh", "is not a field"),
        ('dataset = "mixture"\n[[training.mixture]]\npath = "{corpus}"\nweight = inf\n',
         "training.mixture[0].weight", "finite"),
        ('[validation]\nenable = true\ndataset = "mixture"\n', "validation.dataset",
         "cannot be a mixture"),
    ],
)  # fmt: skip
def test_bad_data_options_fail_clearly(
    tmp_path: Path, corpus: Path, body: str, field: str, needle: str
) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    other_tok = tmp_path / "other_tok"
    shutil.copytree(corpus, other_tok)
    manifest = json.loads((other_tok / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "0" * 64
    (other_tok / "manifest.json").write_text(json.dumps(manifest))
    short = tmp_path / "short"
    shutil.copytree(corpus, short)
    with (short / "shard_00000.bin").open("r+b") as f:
        f.truncate(10)
    text = body.format(corpus=corpus, raw=raw, other_tok=other_tok, short=short)
    with pytest.raises(ConfigError) as e:
        load_config(_toml(tmp_path, text), world_size=1)
    assert e.value.field == field and needle in str(e.value), str(e.value)


def test_mixture_is_toml_only() -> None:
    with pytest.raises(ConfigError, match=r"write \[\[training.mixture\]\] tables"):
        parse_args(["--training.mixture", "a:1"])
