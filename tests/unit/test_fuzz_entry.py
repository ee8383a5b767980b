"""Fuzzing the weight folders the entry points read (issue #37): damaged ``*.safetensors`` and
``config.json`` of a Hugging Face folder through ``python -m torchtitan.convert from-hf`` and
``python -m torchtitan.eval``; damaged DCP step folders through ``to-hf`` and the evaluation;
damaged PEFT folders through the training preflight (``lora.adapter_path``).

Property (docs/errors.md, "Weight folders"): exit 0, or exit 2 with one line that holds a fix;
never a traceback, and the input left as it was. The evaluation runs in process up to its
weights: ``evaluate`` is replaced by the loading of the weights it would evaluate, so an input
the checks accept must load. The fast tier runs a few dozen cases; the ``slow`` tests >= 500.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.bad_files import ROOT, TRAIN
from tests.unit.test_bad_files import run_entry, stat_snapshot
from tests.unit.test_fuzz_files import damaged
from torchtitan.config.errors import ConfigError

FAST = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))


def slow(n: int) -> settings:
    return settings(settings.get_profile("fuzz_slow"), max_examples=n)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tiny llama3 Hugging Face folder (``hf``), a llama3 debugmodel step folder
    (``ck/step-1``) and a PEFT folder for it (``peft``)."""
    from tests.tiny_args import tiny_llama3
    from tests.unit.bad_files import _peft, _peft_weights, _weights
    from torchtitan import convert
    from torchtitan.checkpoint.storage import write_model_weights
    from torchtitan.models import MODELS

    d = tmp_path_factory.mktemp("fuzz_entry")
    args = tiny_llama3(dim=64, heads=(4, 2), vocab=128)
    model = MODELS["llama3"].build(args)
    model.init_weights(seed=0)  # type: ignore[operator]
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    convert.to_hf(write_model_weights(d / "tiny", 0, sd), d / "hf", "llama3", args, None)
    write_model_weights(d / "ck", 1, _weights("llama3")[1])
    good = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"]}
    _peft(d / "peft", good, _peft_weights(8))
    yield d


OUTCOMES: Counter[str] = Counter()
"""Exit codes seen, by entry point (printed by the slow test: how many inputs passed)."""


def _one_line_or_ok(rc: int, err: str, entry: str = "") -> None:
    OUTCOMES[f"{entry} exit {rc}"] += 1
    assert "Traceback" not in err, err[-3000:]
    assert rc in (0, 2), f"exit {rc}: {err[-3000:]}"
    if rc == 2:  # one error line, last; before it only warnings the input caused (an
        # unknown config.json key: models/common/hf/keys.py)
        lines = err.strip().splitlines()
        errors = [ln for ln in lines if ln.startswith(("config error: ", "error: "))]
        assert errors == lines[-1:] and "Fix: " in lines[-1], lines
        assert all("is unknown to" in ln for ln in lines[:-1]), lines


def _load_only(cfg: Any, log_samples: bool = False) -> None:
    """``evaluate`` up to its weights (its own calls, one rank): what the checks accepted must
    load."""
    import torch

    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.eval.__main__ import checkpoint_path
    from torchtitan.eval.loading import checkpoint_args, load_eval_model

    path = checkpoint_path(cfg)
    hf = (path / "config.json").is_file()
    if not hf and not (path / ".metadata").is_file():
        from torchtitan.checkpoint import storage as io

        found = io.find_checkpoint(path, skip_exports=False)
        assert found is not None
        path = found.path
    family, args = checkpoint_args(path, hf, cfg.model.name, cfg.model.flavor)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    device = torch.device("cpu")
    load_eval_model(path, hf, family, args, dims, cfg, device, torch.float32)


def _case(
    work: Path, src: Path, name: str, data: bytes, runs: list[tuple[str, list[str]]], capsys: Any
) -> None:
    """``src`` copied to ``work/in`` with its file ``name`` replaced by ``data``, then each
    (entry point, argv) of ``runs`` (``{in}``/``{out}`` replaced) keeps the property."""
    for sub in ("in", "out"):
        shutil.rmtree(work / sub, ignore_errors=True)
    shutil.copytree(src, work / "in")
    (work / "in" / name).write_bytes(data)
    before = stat_snapshot(work / "in")
    for entry, argv in runs:
        shutil.rmtree(work / "out", ignore_errors=True)
        argv = [
            a.replace("{in}", str(work / "in")).replace("{out}", str(work / "out")) for a in argv
        ]
        rc, err = run_entry(entry, argv, capsys)
        _one_line_or_ok(rc, err, entry)
    assert stat_snapshot(work / "in") == before


# --------------------------------------------------------------------------- strategies
_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-(2**40), -2, -1, 0, 1, 2, 3, 7, 64, 4096, 2**31, 2**62]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)


@st.composite
def damaged_config(draw: st.DrawFn, original: bytes) -> bytes:
    """``config.json`` with keys replaced, removed or added (or its bytes damaged)."""
    config = json.loads(original)
    if draw(st.integers(0, 4)) == 0:
        return draw(damaged(original))
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["replace", "remove", "add"]))
        key = draw(st.sampled_from(sorted(config)))
        if how == "replace":
            config[key] = draw(_JSON_VALUES)
        elif how == "remove":
            config.pop(key, None)
        else:
            config[draw(st.text(min_size=1, max_size=8))] = draw(_JSON_VALUES)
    return json.dumps(config).encode()


@st.composite
def damaged_safetensors(draw: st.DrawFn, original: bytes) -> bytes:
    """Damage in the header (most of the draws: that is what the checks read) or anywhere."""
    header = 8 + int.from_bytes(original[:8], "little")
    if draw(st.booleans()):
        return draw(damaged(original[:header])) + original[header:]
    return draw(damaged(original))


def hf_inputs(src: Path) -> st.SearchStrategy[tuple[str, bytes]]:
    shard = next(src.glob("*.safetensors")).name
    return st.one_of(
        st.tuples(st.just("config.json"), damaged_config((src / "config.json").read_bytes())),
        st.tuples(st.just(shard), damaged_safetensors((src / shard).read_bytes())),
        st.tuples(
            st.just("model.safetensors.index.json"),
            damaged((src / "model.safetensors.index.json").read_bytes()),
        ),
    )


def dcp_inputs(src: Path) -> st.SearchStrategy[tuple[str, bytes]]:
    """One file of the step folder damaged in its first 4 KiB (the rest kept)."""

    def one(name: str) -> st.SearchStrategy[tuple[str, bytes]]:
        data = (src / name).read_bytes()
        head = damaged(data[:4096]).map(lambda b: b + data[4096:])
        return st.tuples(st.just(name), head)

    return st.sampled_from(sorted(p.name for p in src.iterdir())).flatmap(one)


def peft_inputs(src: Path) -> st.SearchStrategy[tuple[str, bytes]]:
    return st.one_of(
        st.tuples(
            st.just("adapter_config.json"),
            damaged_config((src / "adapter_config.json").read_bytes()),
        ),
        st.tuples(
            st.just("adapter_model.safetensors"),
            damaged_safetensors((src / "adapter_model.safetensors").read_bytes()),
        ),
    )


# --------------------------------------------------------------------------- cases
HF_RUNS = [
    ("convert", ["from-hf", "{in}", "{out}", "--model", "llama3", "--no-verify"]),
    ("eval", ["--eval.checkpoint", "{in}"]),
]
DCP_RUNS = [
    ("convert", ["to-hf", "{in}", "{out}", "--model", "llama3", "--flavor", "debugmodel"]),
    ("eval", ["--eval.checkpoint", "{in}"]),
]


def hf_case(work: Path, sources: Path, case: tuple[str, bytes], capsys: Any) -> None:
    _case(work, sources / "hf", *case, HF_RUNS, capsys)


def dcp_case(work: Path, sources: Path, case: tuple[str, bytes], capsys: Any) -> None:
    _case(work, sources / "ck" / "step-1", *case, DCP_RUNS, capsys)


def peft_case(work: Path, sources: Path, case: tuple[str, bytes]) -> None:
    from torchtitan.preflight.validate import load_config

    folder = work / "peft"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(sources / "peft", folder)
    (folder / case[0]).write_bytes(case[1])
    argv = [*TRAIN, "--job.dump_folder", str(work / "run"), "--lora.enable"]
    argv += ["--lora.adapter_targets", "from_adapter"]  # the folder's one adapted module
    try:
        load_config([*argv, "--lora.adapter_path", str(folder)], world_size=1)
        OUTCOMES["train preflight passed"] += 1
    except ConfigError as e:
        assert e.value is not None and "\n" not in str(e) and e.fix, str(e)
        assert e.field == "lora.adapter_path", str(e)
        OUTCOMES["train preflight refused"] += 1


@pytest.fixture()
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("torchtitan.eval.__main__.evaluate", _load_only)
    return tmp_path


def test_fuzz_hf_folders(work: Path, sources: Path, capsys) -> None:
    @settings(FAST, max_examples=10)
    @given(case=hf_inputs(sources / "hf"))
    def run(case: tuple[str, bytes]) -> None:
        hf_case(work, sources, case, capsys)

    run()


def test_fuzz_dcp_and_peft_folders(work: Path, sources: Path, capsys) -> None:
    @FAST
    @given(case=dcp_inputs(sources / "ck" / "step-1"))
    def dcp(case: tuple[str, bytes]) -> None:
        dcp_case(work, sources, case, capsys)

    @settings(FAST, max_examples=12)
    @given(case=peft_inputs(sources / "peft"))
    def peft(case: tuple[str, bytes]) -> None:
        peft_case(work, sources, case)

    dcp()
    peft()


@pytest.mark.slow
def test_fuzz_entry_points_large(work: Path, sources: Path, capsys) -> None:
    """>= 500 cases: 300 Hugging Face folders, 100 DCP folders, 150 PEFT folders."""

    @slow(300)
    @given(case=hf_inputs(sources / "hf"))
    def hf(case: tuple[str, bytes]) -> None:
        hf_case(work, sources, case, capsys)

    @slow(100)
    @given(case=dcp_inputs(sources / "ck" / "step-1"))
    def dcp(case: tuple[str, bytes]) -> None:
        dcp_case(work, sources, case, capsys)

    @slow(150)
    @given(case=peft_inputs(sources / "peft"))
    def peft(case: tuple[str, bytes]) -> None:
        peft_case(work, sources, case)

    hf()
    dcp()
    peft()
    print(f"outcomes: {dict(OUTCOMES)}")
