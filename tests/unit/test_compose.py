"""Config composition (docs/configs.md): ``extends`` chains, several files on the command line,
the precedence between them, their one-line errors, ``--sources``, and the shipped configs
resolving to what they resolved to before they were split into bases and overlays."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from torchtitan.config import ConfigError
from torchtitan.config.__main__ import main as config_main
from torchtitan.config.manager import parse_args, parse_args_with_sources, to_toml

ROOT = Path(__file__).resolve().parents[2]
DEBUG = ROOT / "train_configs" / "debug_model.toml"
# The commit before the shipped configs became bases + overlays (issue #29).
BEFORE_SPLIT = "9af0e75"


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.fixture
def chain(tmp_path: Path) -> dict[str, str]:
    """top.toml -> mid/mid.toml -> base.toml (paths relative to each file)."""
    base = _write(
        tmp_path / "base.toml",
        f'extends = "{DEBUG}"\n[training]\nsteps = 1\nseq_len = 64\nlocal_batch_size = 2\n'
        "[optimizer]\nlr = 0.5\n",
    )
    mid = _write(
        tmp_path / "mid" / "mid.toml",
        'extends = "../base.toml"\n[training]\nsteps = 2\nseq_len = 128\n',
    )
    top = _write(tmp_path / "top.toml", 'extends = "mid/mid.toml"\n[training]\nsteps = 3\n')
    overlay = _write(tmp_path / "overlay.toml", "[optimizer]\nlr = 0.25\n[metrics]\nlog_freq = 7\n")
    return {"base": base, "mid": mid, "top": top, "overlay": overlay}


def test_three_file_chain_precedence_and_sources(chain: dict[str, str]) -> None:
    cfg, sources = parse_args_with_sources(["--job.config_file", chain["top"]])
    t = cfg.training
    # the file nearest the command line wins; each key falls through to the first file that sets it
    assert (t.steps, t.seq_len, t.local_batch_size, cfg.optimizer.lr) == (3, 128, 2, 0.5)
    assert cfg.model.flavor == "debugmodel" and cfg.training.dataset == "test_corpus"
    assert sources["training.steps"] == chain["top"]
    assert sources["training.seq_len"] == chain["mid"]
    assert sources["training.local_batch_size"] == chain["base"]
    assert sources["training.dataset"] == str(DEBUG)
    assert "training.max_norm" not in parse_args_with_sources([])[1]


@pytest.mark.parametrize("joined", [True, False])
def test_several_files_apply_in_order_then_the_command_line(
    chain: dict[str, str], joined: bool
) -> None:
    files = [chain["top"], chain["overlay"]]
    argv = (
        ["--job.config_file", ",".join(files)]
        if joined
        else ["--job.config_file", files[0], "--job.config_file", files[1]]
    )
    cfg, sources = parse_args_with_sources([*argv, "--metrics.log_freq", "9"])
    assert cfg.optimizer.lr == 0.25 and sources["optimizer.lr"] == chain["overlay"]
    assert cfg.training.steps == 3 and cfg.metrics.log_freq == 9
    assert sources["metrics.log_freq"] == "command line"
    assert cfg.job.config_file == ",".join(files)
    # reversed order: the chain (its lr 0.5, debug_model's log_freq 5) wins over the overlay
    rev = parse_args(["--job.config_file", f"{files[1]},{files[0]}"])
    assert rev.optimizer.lr == 0.5 and rev.metrics.log_freq == 5


def _error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    text = str(e.value)
    assert "\n" not in text and "Fix:" in text
    return text


def test_cycle_missing_base_and_unknown_key_are_one_line_errors(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.toml", 'extends = "sub/b.toml"\n')
    _write(tmp_path / "sub" / "b.toml", 'extends = "../a.toml"\n')
    text = _error(["--job.config_file", a])
    assert text.startswith("extends: the chain is a cycle") and "sub/b.toml -> " in text

    missing = _write(tmp_path / "m.toml", 'extends = "nope.toml"\n')
    text = _error(["--job.config_file", missing])
    assert "in " + missing in text and str(tmp_path / "nope.toml") in text

    typo = _write(tmp_path / "typo.toml", "[training]\nstepz = 3\n")
    text = _error(["--job.config_file", f"{DEBUG},{typo}"])
    assert text.startswith("training.stepz: is not a field of [training] (in " + typo + ")")
    assert "did you mean 'steps'" in text

    bad_type = _write(tmp_path / "t.toml", '[training]\nsteps = "x"\n')
    assert "(in " + bad_type + ")" in _error(["--job.config_file", bad_type])
    not_a_path = _write(tmp_path / "n.toml", "extends = 3\n")
    assert "must be a file path" in _error(["--job.config_file", not_a_path])
    # A NUL byte in a path (found by the slow fuzz tier) is a bad path, not a ValueError.
    assert "must be an existing TOML file" in _error(["--job.config_file", "a\x00.toml"])
    nul = _write(tmp_path / "nul.toml", 'extends = "b\\u0000.toml"\n')
    assert "must be a file path" in _error(["--job.config_file", nul])


def test_config_cli_prints_sources(chain: dict[str, str], capsys: pytest.CaptureFixture) -> None:
    argv = ["--job.config_file", chain["top"], "--optimizer.lr", "0.125", "--sources"]
    assert config_main(argv) == 0
    out = capsys.readouterr().out
    assert f"steps = 3  # {chain['top']}" in out
    assert f"seq_len = 128  # {chain['mid']}" in out
    assert "lr = 0.125  # command line" in out
    assert "max_norm = 1.0  # " + str(DEBUG) in out
    assert "gc_freq = 50  # default" in out


def _git_show(rev: str, path: str) -> str | None:
    done = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return done.stdout if done.returncode == 0 else None


@pytest.mark.parametrize(
    "name",
    [
        "debug_model.toml",
        "sft_debug.toml",
        "llama3_8b.toml",
        "llama3_70b.toml",
        "llama3_405b.toml",
        "qwen3_8b.toml",
        "qwen3_30b_a3b.toml",
    ],
)
def test_shipped_configs_resolve_as_before_the_split(tmp_path: Path, name: str) -> None:
    """Each shipped config resolves to the values its one-file version had (every field,
    compared as the resolved TOML); skipped where the git history is not there."""
    old = _git_show(BEFORE_SPLIT, f"train_configs/{name}")
    if old is None:
        pytest.skip(f"commit {BEFORE_SPLIT} not in this checkout")
    old_file = _write(tmp_path / name, old)
    path = str(ROOT / "train_configs" / name)
    before, after = (
        parse_args(["--job.config_file", old_file]),
        parse_args(["--job.config_file", path]),
    )
    before.job.config_file = after.job.config_file
    assert to_toml(after) == to_toml(before)
