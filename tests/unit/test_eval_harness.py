"""lm-eval on our models (docs/evaluation.md): per-request log-likelihoods and generations equal
those of lm-eval's own Hugging Face model (HFLM) on the HF export of the same checkpoint, for
every family; the local tasks and their one-line errors; request sharding."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from tests.eval_helpers import (  # noqa: E402
    HF_TOKENIZER,
    SEQ_LEN,
    TASKS,
    answers,
    eval_config,
    make_checkpoint,
    max_loglikelihood_diff,
)
from torchtitan.config.errors import ConfigError  # noqa: E402
from torchtitan.data.tokenizer import build_tokenizer  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.eval.harness import make_lm, run_tasks, scores  # noqa: E402
from torchtitan.eval.loading import build_eval_model, load_weights  # noqa: E402
from torchtitan.eval.requests import gather, rank_batches  # noqa: E402
from torchtitan.eval.tasks import resolve_tasks  # noqa: E402
from torchtitan.models.common.moe import MoEArgs  # noqa: E402
from torchtitan.models.qwen3 import QWEN3_FLAVORS  # noqa: E402
from torchtitan.preflight.validate_eval import validate_eval  # noqa: E402

LIMIT = 12
TINY_MOE = dataclasses.replace(
    QWEN3_FLAVORS["debugmodel"],
    n_layers=2,
    moe=MoEArgs(num_experts=4, top_k=2, expert_dim=64),
)


def _ours(path: Path, family: str, hf: bool) -> dict[str, Any]:
    cfg = eval_config(path, path, family, limit=LIMIT)
    fam, args, sd = load_weights(path, hf, family, "debugmodel")
    args = dataclasses.replace(args, max_seq_len=SEQ_LEN)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    model = build_eval_model(fam, args, sd, dims, cfg, torch.device("cpu"), torch.float32)
    lm = make_lm(model, build_tokenizer(HF_TOKENIZER), SEQ_LEN, torch.device("cpu"), cfg.eval)
    return run_tasks(lm, resolve_tasks(cfg.eval.tasks, cfg.eval.include_path), cfg.eval, True)


def _hflm(hf: Path) -> dict[str, Any]:
    from lm_eval.models.huggingface import HFLM

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(HF_TOKENIZER)
    # Batch size 1: HFLM left-pads batched prompts, which moves HF's own greedy choices.
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=SEQ_LEN, device="cpu")
    cfg = eval_config(hf, hf, limit=LIMIT)
    return run_tasks(lm, resolve_tasks(cfg.eval.tasks, cfg.eval.include_path), cfg.eval, True)


@pytest.mark.parametrize(
    ("family", "args", "from_hf"),
    [
        ("qwen3", None, False),
        pytest.param("llama3", None, False, marks=pytest.mark.slow),
        pytest.param("qwen3", TINY_MOE, True, marks=pytest.mark.slow),
    ],
    ids=["qwen3-dcp", "llama3-dcp", "qwen3_moe-hf"],
)
def test_matches_lm_eval_hf_model(family: str, args: Any, from_hf: bool, tmp_path: Path) -> None:
    step = make_checkpoint(tmp_path, family, args=args)
    ours = _ours(tmp_path / "hf" if from_hf else step, family, from_hf)
    theirs = _hflm(tmp_path / "hf")
    a, b = answers(ours), answers(theirs)
    diff = max_loglikelihood_diff(a["torchtitan_facts_mc"], b["torchtitan_facts_mc"])
    same_text = sum(x == y for x, y in zip(a["torchtitan_facts_gen"], b["torchtitan_facts_gen"]))
    print(f"{family}: max |loglikelihood diff| vs HFLM {diff:.2e}; {same_text}/{LIMIT} generations")
    assert diff <= 1e-4
    assert len(a["torchtitan_facts_mc"]) == LIMIT and same_text == LIMIT
    assert scores(ours) == scores(theirs)
    gens = [r[0][0] for _, r in a["torchtitan_facts_gen"]]
    assert any(gens), "every generation is empty: the comparison would prove nothing"


def test_tasks_resolve_to_local_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative data_files are read from the YAML's folder
    specs = resolve_tasks(TASKS, ["tests/assets/eval"])
    files = [Path(s["dataset_kwargs"]["data_files"]["test"]) for s in specs]
    assert all(f.is_absolute() and f.is_file() for f in files)
    assert [s["task"] for s in specs] == TASKS


def _error(tasks: list[str], include: list[str]) -> str:
    cfg = eval_config(Path("."), Path("."), tasks=tasks, include_path=include)
    with pytest.raises(ConfigError) as e:
        validate_eval(cfg, standalone=True)
    assert e.value.field == "eval.tasks" and "\n" not in str(e.value)
    return str(e.value)


def test_errors_name_the_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml = Path("tests/assets/eval/torchtitan_facts_mc.yaml").read_text()
    (tmp_path / "lost.yaml").write_text(yaml.replace("task: torchtitan_facts_mc", "task: lost"))
    include = [str(tmp_path)]  # one task index for the three cases
    assert "'no_such_task': is no task" in _error(["no_such_task"], include)
    assert "facts_train.jsonl does not exist" in _error(["lost"], include)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_cache"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert "'arc_easy': needs the network" in _error(["arc_easy"], include)


def test_shard_batches_and_gather_restore_the_order() -> None:
    items = ["ccc", "a", "bb", "dddd", "ee", "f", "ggg"]
    # Sorted longest first: dddd ccc ggg bb ee a f; batches of 2 cut before they are dealt.
    shares = [rank_batches(items, len, 2, r, 3) for r in range(3)]
    assert [[x for _, x in b] for b in shares[0]] == [["dddd", "ccc"], ["f"]]
    assert [[x for _, x in b] for b in shares[1]] == [["ggg", "bb"]]
    one = rank_batches(items, len, 2, 0, 1)
    # Every batch is one of the single rank's: the same rows, hence the same padded width.
    assert sorted(b for s in shares for b in s) == sorted(one)
    assert sorted(i for s in shares for b in s for i, _ in b) == list(range(7))
    grouped = rank_batches(items, len, 3, 0, 1, same_length=len)
    assert [[x for _, x in g] for g in grouped] == [
        ["dddd"],
        ["ccc", "ggg"],
        ["bb", "ee"],
        ["a", "f"],
    ]
    answers_ = [(i, x.upper()) for s in shares for b in s for i, x in b]
    assert gather(answers_, 7, None, 1) == [x.upper() for x in items]


def test_stock_lm_eval_loads_the_shipped_tasks_from_another_cwd(tmp_path: Path) -> None:
    """lm-eval itself (no torchtitan): its TaskManager over ``tests/assets/eval``, run from an
    unrelated working directory, loads both tasks' documents (the YAMLs' ``custom_dataset``
    reads the data files from the YAML's folder; scripts/make_eval_tasks.py)."""
    include = Path("tests/assets/eval").resolve()
    code = (
        "from lm_eval.tasks import TaskManager, get_task_dict\n"
        f"tm = TaskManager(include_path=[{str(include)!r}])\n"
        f"tasks = get_task_dict({TASKS!r}, tm)\n"
        "print(sorted((k, len(list(t.test_docs())), len(list(t.training_docs())))"
        " for k, t in tasks.items()))\n"
    )
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "cache")
    env.pop("PYTHONPATH", None)  # nothing of ours on the path
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last == str(sorted((t, 56, 6) for t in TASKS)), last
