"""Tier 3: training on pretokenized shards equals training on the text path; FSDP 2 on shards
matches one process; a mixture resumes bitwise, and at another data-parallel degree keeps its
data position (docs/data.md)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.checkpoint_helpers import ckpt_argv, fresh_metrics
from tests.distributed.parity_cases import STEPS, reference_metrics
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, assert_losses_match, losses, read_jsonl, train_metrics
from tests.tokenized_helpers import CORPUS, cached_corpus


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = cached_corpus(tmp_path_factory, "train")
    return ["--training.dataset", "tokenized", "--training.dataset_path", str(folder)]


def test_fsdp2_on_tokens_matches_one_process_on_text(
    tokens: list[str], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The shards hold the text path's stream, so FSDP 2 on them matches the one-process
    text-path reference (the shared parity reference) to 1e-5."""
    ref = losses(reference_metrics(tmp_path_factory))
    got = losses(train_metrics([*tokens, "--training.local_batch_size", "4"], 2, tmp_path, STEPS))
    assert_losses_match(ref, got, rtol=1e-5, label="FSDP 2 on tokens vs 1 process on text")


@pytest.mark.slow
def test_one_process_on_tokens_equals_text_path(
    tokens: list[str], tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    ref = losses(reference_metrics(tmp_path_factory))
    got = losses(train_metrics([*tokens, "--training.local_batch_size", "8"], 1, tmp_path, STEPS))
    assert got == ref, (got, ref)


def _train_toml(toml: str, argv: list[str], dump: str) -> list[dict] | None:
    from torchtitan.train import main

    rc = main(["--job.config_file", toml, "--job.dump_folder", dump, *argv])
    assert rc == 0, f"train exited {rc}"
    path = Path(dump) / "metrics" / f"rank_{os.environ['RANK']}.jsonl"
    return read_jsonl(path) if path.exists() else None


def _mixture_run(toml: Path, world: int, dump: Path) -> list[dict]:
    argv = ckpt_argv("--training.local_batch_size", str(8 // world))
    results = run_ranks(_train_toml, world, str(toml), argv, str(dump), timeout=600)
    assert results[0] is not None
    return results[0]


@pytest.mark.slow
def test_mixture_resume_bitwise_and_at_another_dp(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A tokenized + text mixture: 6 straight steps on FSDP 2 (checkpoints at 3 and 6); resumed
    from step 3 on FSDP 2 the losses are bitwise equal, on 1 process equal to 1e-5 (so the
    data position carried over), and the per-source token counts are logged."""
    folder = cached_corpus(tmp_path_factory, "train")
    toml = tmp_path / "mixture.toml"
    toml.write_text(
        Path(DEBUG_TOML).read_text().replace('dataset = "test_corpus"', 'dataset = "mixture"')
        + f'\n[[training.mixture]]\npath = "{folder}"\nweight = 3.0\n'
        f'\n[[training.mixture]]\npath = "{CORPUS / "validation.jsonl"}"\nweight = 1.0\n'
    )
    straight = _mixture_run(toml, 2, tmp_path / "straight")
    names = [folder.name, "validation.jsonl"]
    seen = [straight[-1][f"data/tokens_{n}"] for n in names]
    assert sum(seen) == 6 * 8 * 64 and seen[0] == 3 * seen[1], seen
    for world in (2, 1):
        dump = tmp_path / f"resume_{world}"
        shutil.copytree(
            tmp_path / "straight" / "checkpoint" / "step-3", dump / "checkpoint" / "step-3"
        )
        fresh_metrics(dump)
        resumed = _mixture_run(toml, world, dump)
        assert [m["step"] for m in resumed] == [4, 5, 6]
        if world == 2:
            assert losses(resumed) == losses(straight)[3:]
        else:
            assert_losses_match(losses(straight)[3:], losses(resumed), rtol=1e-5, label="dp 2->1")
        assert [resumed[-1][f"data/tokens_{n}"] for n in names] == seen
