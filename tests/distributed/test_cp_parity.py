"""Tier 3: context parallel trains exactly like one process (fp32, same global batch).

Every sequence of 64 tokens is split over the ``cp`` ranks (head-tail load balanced, 2 x cp
chunks); attention all-gathers K/V over ``cp``. Each case trains 10 steps and is compared step by
step with the single-process run (loss within 1e-5 relative, grad norm within 5e-4). A broken
piece shows up far above that: RoPE by local instead of global positions, a causal mask by local
positions, or gradients averaged over the wrong mesh each move the first loss by > 1e-2.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.distributed.parity_cases import check_parity, reference_metrics
from tests.parity import assert_validation_match, train_metrics
from tests.torch_window import needs_pp_dtensor

STEPS = 10
CP = "--parallelism.context_parallel_degree"
LB = "--training.local_batch_size"
PP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "1F1B",
]

CASES = {
    # id: (world size, overrides)
    "cp2": (2, [CP, "2", LB, "8"]),
    "cp4": (4, [CP, "4", LB, "8"]),
    "fsdp2xcp2": (4, [CP, "2", "--parallelism.data_parallel_shard_degree", "2", LB, "4"]),
    "tp2xcp2": (4, [CP, "2", "--parallelism.tensor_parallel_degree", "2", LB, "8"]),
    "pp2xcp2": (4, [CP, "2", *PP2, LB, "8"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return reference_metrics(tmp_path_factory, steps=STEPS)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.smoke) if c == "cp2" else c for c in CASES]
)
def test_cp_matches_single_process(reference: list[dict], tmp_path: Path, case: str) -> None:
    world, overrides = CASES[case]
    check_parity(reference, overrides, world, tmp_path, label=case)


@pytest.mark.slow
@needs_pp_dtensor
def test_4d_pp2_fsdp2_cp2_tp2(reference: list[dict], tmp_path: Path) -> None:
    """All four axes at once on 16 ranks (the tiny model keeps it to about a minute)."""
    overrides = [CP, "2", "--parallelism.tensor_parallel_degree", "2", *PP2]
    overrides += ["--parallelism.data_parallel_shard_degree", "2", LB, "4"]
    check_parity(reference, overrides, 16, tmp_path, label="PP 2 x FSDP 2 x CP 2 x TP 2")


def test_cp2_validation_loss_matches_single_process(tmp_path: Path) -> None:
    """Validation shards its batches over cp too: the loss and token count match one process."""
    val = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]
    ref = train_metrics([LB, "8", *val], 1, tmp_path / "ref", steps=4)
    got = train_metrics([CP, "2", LB, "8", *val], 2, tmp_path / "cp", steps=4)
    rows = assert_validation_match(ref, got, "CP 2 validation loss")
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [2, 4]


@pytest.mark.slow
def test_cp2_compiled_matches_single_process(reference: list[dict], tmp_path: Path) -> None:
    """Per-block compile traces the K/V all-gather (a functional collective) into the graph."""
    cache = str(Path(tempfile.gettempdir()) / "torchtitan-inductor-cache")  # shared by tests
    compile_args = ["--compile.enable", "--compile.cache_dir", cache]
    overrides = [CP, "2", LB, "8", *compile_args]
    check_parity(reference, overrides, 2, tmp_path, label="CP 2 + compile")


def _shapes_seen(argv: list[str], dump: str) -> dict:
    """One training step; what the model's forward received on this rank."""
    from tests.parity import DEBUG_TOML, TINY
    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    cfg = load_config(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *TINY, *argv])
    trainer = Trainer(cfg)
    seen: dict = {}

    def record(module, args, kwargs):  # type: ignore[no-untyped-def]
        seen["tokens"] = tuple(args[0].shape)
        seen["positions"] = kwargs["positions"].tolist()

    # Registered after apply_cp's positions hook, so it sees what the model will use.
    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.step = 1
    try:
        trainer.train_step()
    finally:
        trainer.close()
        destroy_distributed()
    seen["core"] = type(trainer.model.layers["0"].attention.core).__name__
    return seen


def test_each_cp_rank_trains_on_its_share(tmp_path: Path) -> None:
    """Parity alone cannot tell CP from no CP (both match one process): check that each rank's
    forward gets 64 / 2 tokens, at the head-tail global positions, with the all-gather core."""
    from tests.launcher import run_ranks

    r0, r1 = run_ranks(_shapes_seen, 2, [CP, "2", LB, "8", "--training.steps", "1"], str(tmp_path))
    assert r0["tokens"] == r1["tokens"] == (8, 32)
    assert r0["positions"] == [*range(0, 16), *range(48, 64)]
    assert r1["positions"] == [*range(16, 48)]
    assert r0["core"] == r1["core"] == "AllGatherKVAttention"
