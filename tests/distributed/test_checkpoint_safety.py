"""Tier 3: the trainer refuses what would lose a checkpoint or trust a crafted one (one rank).

One forked rank trains 4 steps (checkpoints at 2 and 4), then, each time with a fresh process
group, tries what must be refused:

- ``load_step 2`` with step-4 present: refused, step-4 untouched (docs/checkpoint.md, "Safety");
  the documented branch (a new folder, ``initial_load_path`` step-2, everything loaded)
  reproduces step-4 bitwise;
- a resume with a changed learning rate and seed: trains on, the warning names both fields;
- a copy whose ``.metadata`` is a crafted pickle, as the resume folder and as
  ``initial_load_path``: refused, the pickle's command never runs ("Trust model");
- every checkpoint corrupted: refused instead of starting over, nothing overwritten.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
from pathlib import Path
from typing import Any

from tests.checkpoint_helpers import assert_checkpoints_identical, ckpt_argv
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML
from tests.unit.test_checkpoint_trust import craft_metadata


def _main(dump: Path, *argv: str) -> str:
    """Train through the entry point; returns "ok", or "rc N: " and the one line it printed on
    stderr (a refused checkpoint is exit 2 with one line, docs/errors.md), or an exception's
    text (the process group is torn down either way)."""
    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.train import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = main(["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(dump), *argv])
        return f"rc {rc}: {err.getvalue().strip()}" if rc else "ok"
    except BaseException as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    finally:
        destroy_distributed()


def _scenario(tmp: str) -> dict[str, Any]:
    from torchtitan.tools.logging import logger

    root = Path(tmp)
    out: dict[str, Any] = {}
    dump = root / "run"
    ckpt = dump / "checkpoint"
    argv = ckpt_argv("--training.local_batch_size", "8", steps=4, interval=2)
    out["train"] = _main(dump, *argv)
    out["steps"] = sorted(p.name for p in ckpt.iterdir())
    step4 = (ckpt / "step-4" / "manifest.json").read_bytes()

    out["load_step_2"] = _main(dump, *argv, "--checkpoint.load_step", "2")
    out["step4_kept"] = (ckpt / "step-4" / "manifest.json").read_bytes() == step4
    # The documented way to branch from step 2: a new folder, everything loaded from step-2.
    out["branch"] = _main(
        root / "branch",
        *argv,
        "--checkpoint.initial_load_path",
        str(ckpt / "step-2"),
        "--checkpoint.no-initial_load_model_only",
    )
    branched = root / "branch" / "checkpoint"
    out["branch_steps"] = sorted(p.name for p in branched.iterdir())
    out["branch_entries"] = assert_checkpoints_identical(ckpt / "step-4", branched / "step-4")

    # Resume (nothing left to train) with settings the restored state overrides.
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    out["changed"] = _main(dump, *argv, "--optimizer.lr", "0.5", "--debug.seed", "11")
    logger.removeHandler(handler)
    out["ignored_warning"] = [m for m in records if "ignores these settings" in m]

    marker = root / "pwned"
    evil = root / "evil"
    shutil.copytree(ckpt / "step-4", evil / "checkpoint" / "step-4")
    craft_metadata(evil / "checkpoint" / "step-4", marker)
    out["evil_resume"] = _main(evil, *argv)
    fresh = root / "fresh"
    out["evil_initial"] = _main(
        fresh, *argv, "--checkpoint.initial_load_path", str(evil / "checkpoint" / "step-4")
    )
    out["marker"] = marker.exists()

    for step in (2, 4):
        f = next((ckpt / f"step-{step}").glob("__0_*.distcp"))
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    out["all_corrupt"] = _main(dump, *argv)
    out["untouched"] = before == {p.name: p.stat().st_mtime_ns for p in ckpt.rglob("*")}
    return out


def test_trainer_refuses_unsafe_resumes_and_crafted_checkpoints(tmp_path: Path) -> None:
    (out,) = run_ranks(_scenario, 1, str(tmp_path), timeout=600)
    assert out["train"] == "ok" and out["steps"] == ["step-2", "step-4"], out
    assert out["load_step_2"].startswith("rc 2: checkpoint error:"), out["load_step_2"]
    assert "newer checkpoints (step-4)" in out["load_step_2"]
    assert "initial_load_path" in out["load_step_2"] and out["step4_kept"]
    # The branch continued from step 2 and reproduced the original step 4 bit for bit.
    assert out["branch"] == "ok", out["branch"]
    assert out["branch_steps"] == ["step-4"] and out["branch_entries"] > 0
    assert out["changed"] == "ok", out["changed"]
    (warning,) = out["ignored_warning"]
    assert "optimizer.lr = 0.5" in warning and "debug.seed = 11" in warning, warning
    # A resume meets it while loading; an initial_load_path the preflight already refuses
    # (preflight/validate_weights.py), before any process group.
    assert out["evil_resume"].startswith("rc 2: checkpoint error:"), out["evil_resume"]
    initial = "rc 2: config error: checkpoint.initial_load_path = "
    assert out["evil_initial"].startswith(initial), out["evil_initial"]
    for key in ("evil_resume", "evil_initial"):
        assert "not one of DCP's metadata types" in out[key], (key, out[key])
    assert not out["marker"], "code from a crafted .metadata ran"
    assert out["all_corrupt"].startswith("rc 2: checkpoint error:"), out["all_corrupt"]
    assert "every checkpoint under" in out["all_corrupt"] and out["untouched"]
