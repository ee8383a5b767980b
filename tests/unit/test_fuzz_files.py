"""Fuzzing the files a run reads (issue #28): data files (JSONL, text, parquet; random, truncated,
bit-flipped), tokenizers (damaged ``tokenizer.json`` and tiktoken ranks files) and a real
checkpoint (truncations and bit flips in each of its files; crafted ``.metadata`` pickles).

Properties: data and tokenizers pass the preflight or fail it with one line naming the field and
the file (``python -m torchtitan.config``, in process); a damaged checkpoint is never accepted
(``verify`` names the damage, the search skips it), a crafted pickle is refused before any of
it runs, and nothing the fuzzer did not write changes. The fast tier runs a small fixed budget;
the ``slow`` tests run >= 500 cases in all.
"""

from __future__ import annotations

import contextlib
import io as stdio
import json
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz_inputs import DEBUG_TOML, ROOT, assert_config_property, snapshot
from tests.launcher import run_ranks

CORPUS = b"".join((ROOT / "tests/assets/test_corpus/train.jsonl").read_bytes().splitlines(True)[:6])
HF_TOKENIZER = (ROOT / "tests/assets/hf_tokenizer/tokenizer.json").read_bytes()
TIKTOKEN = (ROOT / "tests/assets/tokenizer/tokenizer.model").read_bytes()


def slow(n: int) -> settings:
    return settings(settings.get_profile("fuzz_slow"), max_examples=n)


@st.composite
def damaged(draw: st.DrawFn, original: bytes) -> bytes:
    """``original`` truncated, bit-flipped, spliced with random bytes, or replaced."""
    how = draw(st.sampled_from(["truncate", "flip", "splice", "random"]))
    if how == "truncate":
        return original[: draw(st.integers(0, max(len(original) - 1, 0)))]
    if how == "random":
        return draw(st.binary(max_size=300))
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 8))):
        i = draw(st.integers(0, len(data) - 1))
        if how == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        else:
            data[i : i + 4] = draw(st.binary(min_size=1, max_size=6))
    return bytes(data)


# --------------------------------------------------------------------------- data files
def _parquet_bytes() -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.loads(line)["text"] for line in CORPUS.decode().splitlines()[:5]]
    buf = stdio.BytesIO()
    pq.write_table(pa.table({"text": texts}), buf)
    return buf.getvalue()


_RECORD = st.one_of(
    st.dictionaries(st.sampled_from(["text", "body", ""]), st.text(max_size=20), max_size=2),
    st.text(max_size=20),
    st.integers(),
    st.none(),
)
_JSONL = st.lists(_RECORD, max_size=5).map(
    lambda rows: "\n".join(json.dumps(r) for r in rows).encode()
)
DATA_FILES = st.one_of(
    st.tuples(st.just("train.jsonl"), damaged(CORPUS) | _JSONL),
    st.tuples(st.just("train.txt"), damaged(CORPUS) | st.binary(max_size=200)),
    st.tuples(st.just("train.parquet"), damaged(_parquet_bytes())),
)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("fuzz_files")
    (root / "keep.txt").write_text("untouched\n")
    yield root


def _file_case(work: Path, folder_name: str, field: str, name: str, data: bytes) -> None:
    """``data`` as the file ``field`` names: the property holds and nothing else changes."""
    folder = work / folder_name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    (folder / name).write_bytes(data)
    before = snapshot(work)
    argv = ["--job.config_file", DEBUG_TOML, field, str(folder / name)]
    assert_config_property(argv + ["--job.dump_folder", str(work / "out")])
    assert snapshot(work) == before


def data_case(work: Path, name: str, data: bytes) -> None:
    _file_case(work, "data", "--training.dataset_path", name, data)


def tokenizer_case(work: Path, name: str, data: bytes) -> None:
    _file_case(work, "tok", "--model.tokenizer_path", name, data)


TOKENIZERS = st.one_of(
    st.tuples(st.just("tokenizer.json"), damaged(HF_TOKENIZER)),
    st.tuples(st.just("tokenizer.model"), damaged(TIKTOKEN)),
)


@settings(max_examples=8)
@given(case=DATA_FILES)
def test_fuzz_data_files(work: Path, case: tuple[str, bytes]) -> None:
    data_case(work, *case)


@settings(max_examples=20)
@given(case=TOKENIZERS)
def test_fuzz_tokenizers(work: Path, case: tuple[str, bytes]) -> None:
    tokenizer_case(work, *case)


@pytest.mark.slow
@slow(250)
@given(case=DATA_FILES)
def test_fuzz_data_files_large(work: Path, case: tuple[str, bytes]) -> None:
    data_case(work, *case)


@pytest.mark.slow
@slow(150)
@given(case=TOKENIZERS)
def test_fuzz_tokenizers_large(work: Path, case: tuple[str, bytes]) -> None:
    tokenizer_case(work, *case)


# --------------------------------------------------------------------------- checkpoints
def _make_checkpoint(dump: str) -> None:
    from tests.checkpoint_helpers import ckpt_argv
    from torchtitan.train import main

    assert (
        main(
            [
                "--job.config_file",
                DEBUG_TOML,
                "--job.dump_folder",
                dump,
                *ckpt_argv(steps=2, interval=2),
            ]
        )
        == 0
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint of a tiny 2-step run, made once per session."""
    dump = tmp_path_factory.mktemp("fuzz_ckpt")
    run_ranks(_make_checkpoint, 1, str(dump / "run"))
    return dump / "run" / "checkpoint" / "step-2"


CKPT_FILES = ["manifest.json", ".metadata", "__0_0.distcp"]


def checkpoint_case(checkpoint: Path, work: Path, name: str, data: bytes) -> None:
    from torchtitan.checkpoint import storage

    root = work / "ckpt"
    shutil.rmtree(root, ignore_errors=True)
    copy = root / "step-2"
    shutil.copytree(checkpoint, copy)
    original = (copy / name).read_bytes()
    (copy / name).write_bytes(data)
    before = snapshot(root)
    reason = storage.verify(copy)
    if name != storage.MANIFEST and data != original:
        assert reason is not None, f"damaged {name} passed verification"
    if reason is not None:  # the search never returns it
        assert storage.find_checkpoint(root) is None
    else:  # the manifest still lists the same, intact files: it loads as the original
        assert (
            storage.read_model_weights(copy).keys() == storage.read_model_weights(checkpoint).keys()
        )
    assert snapshot(root) == before


@st.composite
def ckpt_damage(draw: st.DrawFn, checkpoint: Path) -> tuple[str, bytes]:
    name = draw(st.sampled_from(CKPT_FILES))
    return name, draw(damaged((checkpoint / name).read_bytes()))


def test_fuzz_checkpoint_files(checkpoint: Path, work: Path) -> None:
    @settings(max_examples=6)
    @given(case=ckpt_damage(checkpoint))
    def run(case: tuple[str, bytes]) -> None:
        checkpoint_case(checkpoint, work, *case)

    run()


@pytest.mark.slow
def test_fuzz_checkpoint_files_large(checkpoint: Path, work: Path) -> None:
    @slow(150)
    @given(case=ckpt_damage(checkpoint))
    def run(case: tuple[str, bytes]) -> None:
        checkpoint_case(checkpoint, work, *case)

    run()


# --------------------------------------------------------------------------- crafted pickles
_GLOBALS = st.sampled_from(
    [
        ("builtins", "exec"),
        ("builtins", "eval"),
        ("os", "system"),
        ("subprocess", "Popen"),
        ("torch", "load"),
        ("torch", "float32"),
        ("collections", "OrderedDict"),
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "__class__"),
        ("pathlib", "Path"),
    ]
)


@st.composite
def crafted_pickles(draw: st.DrawFn, marker: str) -> bytes:
    """A pickle that calls a global (allowed or not) on arguments; ``exec`` touches ``marker``."""
    module, name = draw(_GLOBALS)
    arg = f"open({marker!r}, 'w').close()" if name in ("exec", "eval", "system") else "x"
    body = pickle.PROTO + b"\x04" + b"c" + f"{module}\n{name}\n".encode()
    body += pickle.SHORT_BINUNICODE + bytes([len(arg)]) + arg.encode() + pickle.TUPLE1
    body += pickle.REDUCE + pickle.STOP
    return draw(st.just(body) | damaged(body))


def pickle_case(work: Path, checkpoint: Path, data: bytes) -> None:
    from torchtitan.checkpoint.trust import SafeFileSystemReader, UntrustedCheckpointError

    folder = work / "pickled"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(checkpoint, folder)
    (folder / ".metadata").write_bytes(data)
    with contextlib.suppress(UntrustedCheckpointError):  # the one documented error
        SafeFileSystemReader(str(folder)).read_metadata()
    assert not (work / "pwned").exists(), "a crafted pickle ran"


def test_fuzz_crafted_pickles(work: Path, checkpoint: Path) -> None:
    @settings(max_examples=15)
    @given(data=crafted_pickles(str(work / "pwned")))
    def run(data: bytes) -> None:
        pickle_case(work, checkpoint, data)

    run()


@pytest.mark.slow
def test_fuzz_crafted_pickles_large(work: Path, checkpoint: Path) -> None:
    @slow(100)
    @given(data=crafted_pickles(str(work / "pwned")))
    def run(data: bytes) -> None:
        pickle_case(work, checkpoint, data)

    run()
