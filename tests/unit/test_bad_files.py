"""Every bad weight folder of docs/errors.md "Weight folders" (tests/unit/bad_files.py) gets one
line naming the argument or field, what is wrong and a fix, exit 2, from the converter, the
evaluation and the training preflight, before any process group or model; nothing on disk
changes. The converter and the evaluation run in process (``main(argv)``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.bad_files import CASES, EVAL, ROOT, TRAIN, argv_of, make_weight_folders
from torchtitan.config.errors import ConfigError


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("weights")
    make_weight_folders(d)
    return d


def stat_snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under ``root``: what a refused run must leave alone."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run_entry(entry: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit code, stderr) of ``convert`` / ``eval`` run in this process."""
    if entry == "convert":
        from torchtitan.convert import main

        argv = [*argv, *([] if "--model" in argv else ["--model", "llama3"])]
        if argv[0] == "to-hf" and "--flavor" not in argv:
            argv += ["--flavor", "debugmodel"]
    else:
        from torchtitan.eval.__main__ import main

        argv = [*EVAL, *argv]
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().err


def test_every_case_is_in_the_docs() -> None:
    assert len(CASES) >= 50 and len({c[0] for c in CASES}) == len(CASES)
    docs = (ROOT / "docs" / "errors.md").read_text()
    for case_id, _entry, _args, words in CASES:
        assert words.replace("{d}", "<dir>") in docs, f"docs/errors.md lacks {case_id}: {words!r}"


@pytest.mark.parametrize(
    ("entry", "args", "words"),
    [c[1:] for c in CASES if c[1] != "train"],
    ids=[c[0] for c in CASES if c[1] != "train"],
)
def test_convert_and_eval_refuse_in_one_line(
    entry: str, args: list[str], words: str, weights_dir: Path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(ROOT)
    for out in ("o1", "o2"):  # left by a failed case: each case starts without them
        shutil.rmtree(weights_dir / out, ignore_errors=True)
    before = stat_snapshot(weights_dir)
    rc, err = run_entry(entry, argv_of(args, weights_dir), capsys)
    lines = err.strip().splitlines()
    assert rc == 2, err[-3000:]
    assert len(lines) == 1 and "Fix: " in lines[0], lines
    assert words.replace("{d}", str(weights_dir)) in lines[0], lines[0]
    assert stat_snapshot(weights_dir) == before
    for out in ("o1", "o2"):
        assert not (weights_dir / out).exists()


@pytest.mark.parametrize(
    ("args", "words"),
    [c[2:] for c in CASES if c[1] == "train"],
    ids=[c[0] for c in CASES if c[1] == "train"],
)
def test_training_preflight_refuses(
    args: list[str], words: str, weights_dir: Path, monkeypatch
) -> None:
    from torchtitan.preflight.validate import load_config

    monkeypatch.chdir(ROOT)
    argv = [*TRAIN, "--job.dump_folder", str(weights_dir / "run"), *argv_of(args, weights_dir)]
    with pytest.raises(ConfigError) as e:
        load_config(argv, world_size=1)
    field = "lora.adapter_path" if "--lora.adapter_path" in args else "checkpoint.initial_load_path"
    assert e.value.field == field, str(e.value)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_good_folders_pass(weights_dir: Path, monkeypatch) -> None:
    """The undamaged originals pass the same checks (so each refusal above is the damage's)."""
    from torchtitan.preflight.validate import load_config

    monkeypatch.chdir(ROOT)
    dump = ["--job.dump_folder", str(weights_dir / "run")]
    for extra in (
        [
            "--checkpoint.initial_load_path",
            str(weights_dir / "hf"),
            "--checkpoint.initial_load_in_hf",
        ],
        ["--checkpoint.initial_load_path", str(weights_dir / "ck" / "step-1")],
    ):
        load_config([*TRAIN, *dump, *extra], world_size=1)
    from torchtitan.eval.__main__ import checkpoint_path
    from torchtitan.preflight.validate_weights import validate_eval_checkpoint

    for folder in ("hf", "ck", "ck/step-1"):
        cfg = load_config([*EVAL, "--eval.checkpoint", str(weights_dir / folder)], world_size=1)
        validate_eval_checkpoint(cfg, checkpoint_path(cfg))


def _subprocess(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_entry_points_exit_2_without_traceback(weights_dir: Path) -> None:
    """As the user runs them: ``python -m torchtitan.convert`` and the evaluation; a config
    error from the evaluation comes before lm-eval is imported (it used to take 13-30 s).
    Training turns the preflight's ConfigError into exit 2 (tests/unit/test_train_exit_codes.py)."""
    d = str(weights_dir)
    runs = [
        ["-m", "torchtitan.convert", "from-hf", f"{d}/hf_trunc", f"{d}/o3", "--model", "llama3"],
        ["-c", "import sys; from torchtitan.eval.__main__ import main; rc = main(sys.argv[1:]); "
         "print('lm_eval' in sys.modules); sys.exit(rc)", *EVAL,
         "--eval.checkpoint", f"{d}/hf_gpt2"],
    ]  # fmt: skip
    for args in runs:
        proc = _subprocess(args, ROOT)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
        assert len(errors) == 1 and "Fix: " in errors[0], proc.stderr[-3000:]
    assert proc.stdout.strip() == "False", "lm-eval was imported before the config error"
