"""Streaming Hugging Face I/O (docs/hf_io.md) in one process, for every family in ``MODELS``:
sharded export loads in ``transformers`` with equal logits, the streaming re-import is
bit-identical to the weights exported and to the full-load path, and any box of any tensor
read through ``from_hf_box`` equals the same box of the full conversion (fused expert layout
included)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_args import tiny_hf_cases
from torchtitan.checkpoint.hf_io import load_hf_streaming, save_hf_streaming
from torchtitan.checkpoint.storage import read_hf_folder
from torchtitan.models import MODELS

transformers = pytest.importorskip("transformers")
CASES = tiny_hf_cases()


def test_every_family_has_a_case() -> None:
    families = {f for f, args in CASES.values() if MODELS[f].state_dict_adapter(args)}
    declared = {name for name, spec in MODELS.items() if getattr(spec, "hf", None) is not None}
    assert families == declared, f"add a tiny case for {declared - families}"


def model_of(case: str, seed: int) -> torch.nn.Module:
    """The case's model with seeded weights and non-trivial norms (so a wrong permutation of
    a norm weight shows)."""
    family, args = CASES[case]
    model = MODELS[family].build(args)
    model.init_weights(seed=seed)  # type: ignore[operator]
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_export_loads_in_transformers_and_reimports_bitwise(
    case: str, tmp_path: Path
) -> None:
    family, args = CASES[case]
    adapter = MODELS[family].state_dict_adapter(args)
    model = model_of(case, seed=3)
    sd = dict(model.state_dict())
    save_hf_streaming(sd, adapter, tmp_path, max_shard_bytes=64 << 10)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[-1].endswith(f"-of-{len(files):05d}.safetensors"), files
    config = json.loads((tmp_path / "config.json").read_text())
    hf_cls = getattr(transformers, config["architectures"][0])  # e.g. LlamaForCausalLM
    hf = hf_cls.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        diff = (model(_tokens(args.vocab_size)) - hf(_tokens(args.vocab_size)).logits).abs().max()
    print(f"{case}: ours vs transformers {type(hf).__name__}: max abs logit diff {diff:.2e}")
    assert diff <= 1e-5, diff

    fresh = model_of(case, seed=11)
    progress = load_hf_streaming([fresh], adapter, tmp_path)
    got = fresh.state_dict()
    full = adapter.from_hf(read_hf_folder(tmp_path)[1])
    assert set(full) == set(sd) == set(got)
    bad = [k for k in sd if not (torch.equal(got[k], sd[k]) and torch.equal(full[k], sd[k]))]
    assert not bad, f"{case}: differ after the round trip: {bad[:5]}"
    hf_bytes = sum(t.nbytes for t in read_hf_folder(tmp_path)[1].values())
    assert progress.done <= hf_bytes, (progress.done, hf_bytes)


class DictSource:
    """An in-memory ``HFSource`` (the interface ``hf_io.SafetensorsFolder`` implements)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.bytes_read = 0

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, box: Any) -> torch.Tensor:
        t = self.tensors[name][box].clone()
        self.bytes_read += t.nbytes
        return t


def _fused(hf: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory expert layout: ``gate_up_proj [E, 2 * hidden, dim]``."""
    out = {k: v for k, v in hf.items() if ".mlp.experts." not in k}
    layers = {k.split(".mlp.experts.")[0] for k in hf if ".mlp.experts." in k}
    for p in layers:

        def stack(proj: str, p: str = p) -> torch.Tensor:
            return torch.stack([hf[f"{p}.mlp.experts.{e}.{proj}.weight"] for e in range(n_experts)])

        out[f"{p}.mlp.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], 1)
        out[f"{p}.mlp.experts.down_proj"] = stack("down_proj")
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_any_box_reads_only_its_bytes_and_equals_the_full_conversion(case: str) -> None:
    family, args = CASES[case]
    adapter: Any = MODELS[family].state_dict_adapter(args)
    sd = dict(model_of(case, seed=5).state_dict())
    hf = adapter.to_hf(sd)
    sources = [DictSource(hf)]
    if any(".mlp.experts.0.gate_proj.weight" in k for k in hf):  # per-expert HF layout
        sources.append(DictSource(_fused(hf, args.moe.num_experts)))
    gen = torch.Generator().manual_seed(0)
    for source in sources:
        for key, w in sd.items():
            for _ in range(4):
                box = []
                for n in w.shape:
                    a, b = sorted(torch.randint(0, n + 1, (2,), generator=gen).tolist())
                    box.append(slice(a, b))
                before = source.bytes_read
                got = adapter.from_hf_box(key, tuple(w.shape), tuple(box), source)
                assert torch.equal(got.to(w.dtype), w[tuple(box)]), (key, box)
                # exactly the box, RoPE rows too (a head the box cuts: two reads); nothing
                # for a tensor HF has no name for (zeros)
                meta = torch.empty(w.shape, device="meta")
                hf_less = not adapter.to_hf_one(key, meta, check=False) and not adapter.tied_to(key)
                want = 0 if hf_less else got.nbytes
                assert source.bytes_read - before == want, (key, box)


class _WholeOnly:
    """A transform declaring no slicing (only ``to_hf``/``from_hf``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def to_hf(self, w: torch.Tensor, args: Any) -> torch.Tensor:
        return self.inner.to_hf(w, args)

    def from_hf(self, w: torch.Tensor, args: Any) -> torch.Tensor:
        return self.inner.from_hf(w, args)


def test_a_transform_without_slicing_reads_its_whole_tensor() -> None:
    import dataclasses

    from torchtitan.models.common.hf import RopeRows, StateDictAdapter
    from torchtitan.models.llama3.hf import LLAMA3_HF

    _, args = CASES["llama3"]
    mapping = dataclasses.replace(
        LLAMA3_HF, transforms={"attention.wq.weight": _WholeOnly(RopeRows("n_heads"))}
    )
    adapter = StateDictAdapter(mapping, args)
    sd = dict(model_of("llama3", seed=4).state_dict())
    source = DictSource(adapter.to_hf(sd))
    w = sd["layers.1.attention.wq.weight"]
    box = (slice(5, 40), slice(3, 9))
    got = adapter.from_hf_box("layers.1.attention.wq.weight", tuple(w.shape), box, source)
    assert torch.equal(got, w[box]) and source.bytes_read == w.nbytes


@pytest.mark.parametrize("cols", [0, 3], ids=["vector", "matrix"])
def test_rope_rows_read_exactly_every_row_range(cols: int) -> None:
    """Every row range of a 3-head RoPE tensor (head_dim 8), cut heads included, equals the
    full conversion and reads exactly its bytes (FSDP's boundaries fall inside heads)."""
    from types import SimpleNamespace

    from torchtitan.models.common.hf import RopeRows

    rows = RopeRows(None if cols == 0 else "n_heads")
    args = SimpleNamespace(n_heads=3)
    shape = (24,) if cols == 0 else (24, cols)
    ours = torch.arange(24 * max(cols, 1), dtype=torch.float32).reshape(shape)
    hf = rows.to_hf(ours, args)
    for a in range(24):
        for b in range(a + 1, 25):
            reads: list[int] = []

            def read(box: Any, reads: list[int] = reads) -> torch.Tensor:
                reads.append(hf[box].numel())
                return hf[box].clone()

            box = (slice(a, b), *(() if cols == 0 else (slice(1, 3),)))
            got = rows.from_hf_box(read, box, shape, args)
            assert torch.equal(got, ours[box]), (a, b)
            assert sum(reads) == got.numel(), (a, b, reads)
