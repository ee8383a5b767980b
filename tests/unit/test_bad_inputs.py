"""Every bad input of docs/errors.md "Common errors" gets a ConfigError naming its field, with
the words of the table (pure validation: no process group), and the table is in the docs. Data
problems met while reading (past what the preflight decodes) name the file and line too."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.bad_inputs import CASES, CONFIG, argv_of, make_bad_files
from torchtitan.config.errors import ConfigError
from torchtitan.data.checks import DataError
from torchtitan.data.dataloader import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.preflight.validate import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    make_bad_files(d)
    return d


def test_enough_cases_and_all_in_the_docs() -> None:
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
    docs = (ROOT / "docs" / "errors.md").read_text()
    for _id, args, _world, _field, words in CASES:
        shown = " ".join(args).replace("{d}", "<dir>")
        assert f"`{shown}`" in docs, f"docs/errors.md lacks {shown!r}"
        assert words in docs, f"docs/errors.md lacks the message words {words!r}"


@pytest.mark.parametrize(
    ("args", "world", "field", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_message(
    args: list[str],
    world: int,
    field: str,
    words: str,
    bad_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as e:
        load_config(argv_of(args, bad_dir), world_size=world)
    assert e.value.field == field, str(e.value)
    assert words.replace("<dir>", str(bad_dir)) in str(e.value), str(e.value)
    assert e.value.fix, str(e.value)


def _loader(path: Path, split: str = "train", infinite: bool = True):  # noqa: ANN202
    tok = build_tokenizer("tests/assets/tokenizer")
    return build_dataloader("json", str(path), tok, 16, 2, 0, 1, split=split, infinite=infinite)


def test_reading_errors_name_file_and_line(tmp_path: Path) -> None:
    """What the preflight does not see (it decodes the first MiB) fails the same way at run
    time: no bare StopIteration or pyarrow error."""
    good = json.dumps({"text": "hello world " * 20}) + "\n"
    bad = tmp_path / "late_bad.jsonl"
    bad.write_text(good * 3 + "{broken\n")
    with pytest.raises(DataError, match=re.escape(f"{bad}, line 4: the record is not a JSON")) as e:
        for _ in _loader(bad):
            pass
    assert e.value.field == "training.dataset_path"

    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(DataError, match="holds no records for split 'train'"):
        next(iter(_loader(blank)))

    notext = tmp_path / "notext.jsonl"
    notext.write_text(good * 3 + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{notext}, line 4: the record has no 'text'")):
        for _ in _loader(notext):
            pass


def test_reading_errors_name_the_mixture_source_and_the_validation_field(tmp_path: Path) -> None:
    """At run time too, errors about a ``[[training.mixture]]`` source or the validation data name
    that source's or validation's field, not ``training.dataset_path``."""
    from torchtitan.config.job_config import MixtureSource
    from torchtitan.data.builder import DataOptions, build_data_loader

    tok = build_tokenizer("tests/assets/tokenizer")
    good = json.dumps({"text": "hello world " * 20}) + "\n"
    bad = tmp_path / "late_bad.jsonl"
    bad.write_text(good * 3 + "{broken\n")
    mixture = [MixtureSource(path="tests/assets/test_corpus"), MixtureSource(path=str(bad))]
    options = DataOptions(mixture=mixture)
    with pytest.raises(DataError, match=re.escape(f"{bad}, line 4: the record is not a JSON")) as e:
        for _ in build_data_loader("mixture", None, tok, 16, 2, 0, 1, options=options):
            pass
    assert e.value.field == "training.mixture[1].path", str(e.value)

    nodata = tmp_path / "nodata"
    nodata.mkdir()
    (nodata / "validation.jsonl").write_text(good)
    mixture = [MixtureSource(path=str(nodata))]
    with pytest.raises(DataError, match="no data files for split 'train'") as e:
        build_data_loader("mixture", None, tok, 16, 2, 0, 1, options=DataOptions(mixture=mixture))
    assert e.value.field == "training.mixture[0].path", str(e.value)

    (nodata / "validation.jsonl").rename(nodata / "train.jsonl")
    with pytest.raises(DataError, match="no data files for split 'validation'") as e:
        _loader(nodata, split="validation")
    assert e.value.field == "validation.dataset_path", str(e.value)


def test_offline_unknown_hub_dataset_is_one_message(tmp_path: Path) -> None:
    """Not a preflight check (opening a hub dataset needs the network or the cache): the trainer
    meets it while building the data, before any step, and reports one line, exit 2."""
    # HF_DATASETS_OFFLINE is read when `datasets` is imported: a fresh process.
    cmd = [sys.executable, "-m", "torchtitan.train", "--job.config_file"]
    cmd += ["train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path / "out")]
    cmd += ["--training.dataset", "no-such-user/no-such-dataset"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    env["HOME"] = str(tmp_path)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    want = "config error: training.dataset = 'no-such-user/no-such-dataset': could not be opened"
    assert want in proc.stderr and "OfflineModeIsEnabled" in proc.stderr
    assert "Traceback" not in proc.stderr


# `python -m torchtitan.planner`'s own options: exit 2 and one line naming the option (docs/planning.md)
PLAN_CASES = [
    (["--world_size", "8", "--device_memory_gib", "-5"], "--device_memory_gib = -5.0: must be a"),
    (
        ["--world_size", "0", "--device_memory_gib", "80"],
        "--world_size = 0: must be an integer >= 1",
    ),
    (
        ["--world_size", "8", "--device_memory_gib", "80", "--nodes", "3"],
        "--nodes = 3: must divide",
    ),
    (["--world_size", "8", "--device_memory_gib", "80", "--nodes", "0"], "--nodes = 0: must be an"),
    (
        ["--world_size", "8", "--device_memory_gib", "80", "--mfu", "2"],
        "--mfu = 2.0: must be in (0",
    ),
    (["--world_size", "8", "--device_memory_gib", "80", "--top", "0"], "--top = 0: must be an"),
    (["--world_size", "8", "--device_memory_gib", "nan"], "--device_memory_gib = nan: must be a"),
    (["--world_size", "8"], "--device_memory_gib: is required"),
]


@pytest.mark.parametrize(("args", "words"), PLAN_CASES, ids=[c[1].split()[0] for c in PLAN_CASES])
def test_plan_option_errors_exit_2(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchtitan.planner.__main__ import main as plan_main

    rc = plan_main(["--job.config_file", str(ROOT / "train_configs" / "llama3_8b.toml"), *args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    assert len(err.strip().splitlines()) == 1 and words in err and "Fix: " in err, err
    if args[:2] == ["--world_size", "0"]:
        assert "--nodes" not in err  # the bad option is named, not its neighbour


def test_validating_skips_the_fit_check_launching_runs_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m torchtitan.config`` validates a layout for any machine; with ``--launch``
    (what run_train.sh passes) it checks this machine's memory too (here: 1 GiB of host)."""
    from torchtitan.config.__main__ import main as config_main
    from torchtitan.planner import fit

    class Small:
        available = 2**30

    monkeypatch.setattr(fit.psutil, "virtual_memory", lambda: Small())
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    argv = [
        "--job.config_file",
        str(ROOT / "train_configs" / "llama3_8b.toml"),
        "--world_size",
        "8",
    ]
    assert config_main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert config_main(["--launch", *argv]) == 2
    err = capsys.readouterr().err
    assert "config error: job.fit_check = 'error': the job does not fit: 8 rank(s)" in err
    assert "of the 1.00 GiB of host memory available" in err
    assert "--launch" in (ROOT / "run_train.sh").read_text()


def test_mtp_depth_bound_is_what_the_model_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.mtp_depth <= seq_len - 2``: at the bound the deepest module keeps one target;
    one deeper it has none; at ``seq_len`` the shifted tokens no longer stack (the old failure,
    a ``torch.stack`` error once the model was built)."""
    import torch

    from torchtitan.models.deepseek_v3.mtp import IGNORE, mtp_tokens

    seq = 8
    tokens = torch.arange(2 * seq).reshape(2, seq)
    at_bound = mtp_tokens(tokens, seq - 2)
    assert at_bound.shape == (2, seq, seq - 1)
    assert int((at_bound[..., -1] != IGNORE).sum()) == 2  # one target per sequence
    assert bool((mtp_tokens(tokens, seq - 1)[..., -1] == IGNORE).all())  # no target at all
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        mtp_tokens(tokens, seq)
    monkeypatch.chdir(ROOT)
    base = ["--model.name", "deepseek_v3", "--training.seq_len", str(seq)]
    load_config([*CONFIG, *base, "--model.mtp_depth", str(seq - 2)], world_size=1)
    with pytest.raises(ConfigError, match="must be at most training.seq_len - 2 = 6"):
        load_config([*CONFIG, *base, "--model.mtp_depth", str(seq - 1)], world_size=1)


def test_exclude_from_loading_takes_the_optional_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parts some runs add (DPO/GRPO's ``posttrain``, DiLoCo's ``diloco``) may be left
    unloaded like the six every checkpoint has; a name of no part is refused, listing them all."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(["--checkpoint.exclude_from_loading", "diloco,posttrain,optimizer"])
    assert cfg.checkpoint.exclude_from_loading == ["diloco", "posttrain", "optimizer"]
    with pytest.raises(ConfigError) as e:
        load_config(["--checkpoint.exclude_from_loading", "outer"])
    assert e.value.field == "checkpoint.exclude_from_loading"
    assert "'diloco'" in e.value.fix and "'posttrain'" in e.value.fix, str(e.value)
