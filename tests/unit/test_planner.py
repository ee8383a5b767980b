"""Parallelism planner (``python -m torchtitan.planner``) and preflight explain (``--job.explain``).

The seed scales: Llama 3 8B on 8, 70B on 256 and 405B on 512 devices of 80 GiB, with the seed
configs (train_configs/llama3_*.toml) and the Llama 3 vocabulary (128256; the configs point at
the small test tokenizer). docs/planning.md compares the plans with TorchTitan's published
layouts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from torchtitan.config.manager import parse_args
from torchtitan.planner.__main__ import main as plan_main
from torchtitan.planner.estimator import GIB, model_args_for
from torchtitan.planner.planner import Hardware, PlanResult, plan
from torchtitan.preflight.validate import validate_config

# Planning rules as on torch >= 2.13 (V schedules and PP x TP are refused on 2.11).
pytestmark = pytest.mark.usefixtures("newest_torch_rules")

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128256


def _plan(
    name: str, world_size: int, memory_gib: float = 80, vocab: int = VOCAB
) -> list[PlanResult]:
    cfg = parse_args(["--job.config_file", str(ROOT / "train_configs" / name)])
    args = model_args_for(cfg, vocab_size=vocab)
    results, n_layouts, too_big = plan(cfg, args, world_size, Hardware(memory_gib=memory_gib))
    print(f"{name} on {world_size}: {n_layouts} layouts, {too_big} too big, {len(results)} fit")
    for i, r in enumerate(results[:5], start=1):
        print(
            f"  #{i} {r.tokens_per_s_per_device:7.0f} tokens/s  {r.memory.total / GIB:5.1f} GiB  "
            f"{r.layout.describe()}"
        )
    return results


def _check_override_line(name: str, r: PlanResult, world_size: int) -> None:
    """The printed override line parses and validates on the real world size."""
    argv = ["--job.config_file", str(ROOT / "train_configs" / name)]
    for item in r.layout.overrides():
        argv += item.split(" ")
    cfg = parse_args(argv)
    validate_config(cfg, world_size=world_size)
    p = cfg.parallelism
    assert (p.data_parallel_shard_degree, p.tensor_parallel_degree) == (
        r.layout.dp_shard,
        r.layout.tp,
    )
    assert p.pipeline_parallel_degree == r.layout.pp


def test_8b_on_8_gpus_is_fsdp_8() -> None:
    results = _plan("llama3_8b.toml", 8)
    top = results[0].layout
    assert (top.dp_shard, top.dp_replicate, top.tp, top.pp, top.cp) == (8, 1, 1, 1, 1)
    assert results[0].memory.total <= 0.9 * 80 * GIB
    _check_override_line("llama3_8b.toml", results[0], 8)


def test_70b_on_256_gpus_is_fsdp_with_tp_inside_a_node() -> None:
    """FSDP x TP (2D), TP inside a node. The model ranks TP 4 a little above TorchTitan's TP 8
    (fewer activation collectives; docs/planning.md gives the numbers)."""
    results = _plan("llama3_70b.toml", 256)
    top = results[0].layout
    assert top.tp in (4, 8) and top.dp_shard > 1, top.describe()
    assert (top.pp, top.cp, top.dp_replicate) == (1, 1, 1), top.describe()
    # TorchTitan's published layout (FSDP 32 x TP 8) fits and is ranked.
    published = [r for r in results if (r.layout.dp_shard, r.layout.tp, r.layout.pp) == (32, 8, 1)]
    assert published, "FSDP 32 x TP 8 should fit in 80 GiB"
    print(
        f"FSDP 32 x TP 8 best: {published[0].tokens_per_s_per_device:.0f} tokens/s, "
        f"rank {results.index(published[0]) + 1}"
    )
    _check_override_line("llama3_70b.toml", results[0], 256)


def test_405b_on_512_gpus_is_3d() -> None:
    results = _plan("llama3_405b.toml", 512)
    top = results[0].layout
    assert top.tp == 8 and top.pp > 1 and top.dp_shard > 1, top.describe()
    _check_override_line("llama3_405b.toml", results[0], 512)


def test_every_ranked_layout_fits_and_a_smaller_device_changes_the_plan() -> None:
    big = _plan("llama3_8b.toml", 8, memory_gib=80)
    small = _plan("llama3_8b.toml", 8, memory_gib=24)
    assert all(r.memory.total <= 0.9 * 24 * GIB for r in small)
    assert small and len(small) < len(big)
    # 70B does not fit on 8 x 40 GiB without the memory levers; with CPU offload it does (and
    # QLoRA, sharded by FSDP, is proposed after it: docs/lora.md).
    levered = _plan("llama3_70b.toml", 8, memory_gib=40)
    full = [r for r in levered if "lora" not in r.layout.levers]
    assert full and all("cpu_offload" in r.layout.levers for r in full)
    assert levered[: len(full)] == full


def test_cli_prints_plans_with_override_lines(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(ROOT / "train_configs" / "llama3_8b.toml")
    rc = plan_main(
        [
            "--job.config_file",
            config,
            "--world_size",
            "8",
            "--device_memory_gib",
            "80",
            "--vocab_size",
            str(VOCAB),
            "--top",
            "2",
        ]
    )
    out = capsys.readouterr().out
    print(out)
    assert rc == 0
    assert out.count("run with: --parallelism.data_parallel_replicate_degree") == 2
    assert "#1  FSDP 8;" in out and "tokens/s per device" in out
    assert plan_main(["--job.config_file", config, "--device_memory_gib", "80"]) == 2
    rc = plan_main(
        [
            "--job.config_file",
            config,
            "--world_size",
            "1",
            "--device_memory_gib",
            "8",  # even offloaded with AC full, 8B needs ~12 GiB on the device
            "--vocab_size",
            str(VOCAB),
        ]
    )
    assert rc == 1 and "no layout fits" in capsys.readouterr().out


# ---------------------------------------------------------------------- preflight explain
def test_train_explain_prints_the_plan_and_exits_before_any_process_group(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtitan.train import main as train_main

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.delenv("RANK", raising=False)
    rc = train_main(
        [
            "--job.config_file",
            str(ROOT / "train_configs" / "debug_model.toml"),
            "--job.explain",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.global_batch_size",
            "32",
        ]
    )
    out = capsys.readouterr().out
    print(out)
    assert rc == 0 and not dist.is_initialized()
    for expected in (
        "pp = 2",
        "dp_shard = 2",
        "tp = 2",
        "global 32 sequences x 512 tokens = 16,384 tokens",
        "8 sequences per micro-step x 2 gradient-accumulation step(s)",
        "2 stages (1 per rank), 2 microbatches of 4 sequence(s)",
        "bubble: (pp - 1) / (stages per rank x microbatches) = 50.0%",
        "optimizer states:",
        "activations:",
        "pipeline microbatches (2) below 2 x stages (4)",
    ):
        assert expected in out, expected


def test_config_explain_appends_the_plan_to_the_toml(capsys: pytest.CaptureFixture[str]) -> None:
    from torchtitan.config.__main__ import main as config_main

    rc = config_main(
        [
            "--job.config_file",
            str(ROOT / "train_configs" / "debug_model.toml"),
            "--job.explain",
            "--world_size",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "[parallelism]" in out and "explain = true" in out
    assert "dp_shard = 2" in out and "warnings: none" in out
    # 6.2 M parameters: fp32 shards of half of them, two AdamW moments.
    assert "parameters: 11.8 MiB" in out and "optimizer states: 23.5 MiB" in out


@pytest.mark.parametrize(
    ("layout", "term"),
    [
        (dict(dp_replicate=8, dp_shard=1, pp=1, local_batch_size=1), "fsdp_total"),
        (dict(dp_replicate=1, dp_shard=4, pp=2, local_batch_size=2), "pp_p2p"),
    ],
)
def test_groups_inside_one_node_use_its_links_not_the_network(layout: dict, term: str) -> None:
    """DDP's all-reduce and the pipeline's sends stay inside the node while the whole mesh
    fits in it: a slower network changes nothing; spread over 8 nodes, it does."""
    from torchtitan.planner.cost_model import step_time
    from torchtitan.planner.layout import Layout

    cfg = parse_args(["--job.config_file", str(ROOT / "train_configs" / "llama3_8b.toml")])
    args = model_args_for(cfg, vocab_size=VOCAB)
    lay = Layout(tp=1, cp=1, ac_mode="full", ac_option="", global_batch_size=8, **layout)
    if lay.pp > 1:
        lay = Layout(**{**lay.__dict__, "microbatches": 2})

    def term_s(**hw: float) -> float:
        return step_time(cfg, args, lay, Hardware(memory_gib=80, **hw), 8)[1][term]

    assert term_s() > 0
    assert term_s(inter_node_gbps=0.1) == term_s()
    assert term_s(inter_node_gbps=0.1, gpus_per_node=1) > 10 * term_s(gpus_per_node=1)
