"""A family's Hugging Face weight format, declared as data (docs/extending.md, section 5).

:class:`HFMapping` says how a full (unsharded) state dict of ours corresponds to a transformers
checkpoint: name tables for the top-level and per-layer tensors, per-tensor transforms (each
with its inverse), the stacking of per-expert weights, the tensors only we have and the tied
head. ``hf/adapter.py`` applies a mapping both ways, ``hf/config.py`` translates the args.

Every transform here is exact (a permutation, a transpose, a split or a stack: no arithmetic),
so HF -> ours -> HF is bit-identical.

Each transform also says which source bytes a *box* of our tensor needs (``from_hf_box``: one
``slice(start, stop)`` per dimension, e.g. the rows of this rank's FSDP shard), so a rank can
read only what it owns from lazily opened files (docs/hf_io.md): exactly the box's bytes. RoPE
rows are permuted within a head: whole heads are read in one run and permuted, a head the box
cuts in two runs (its even and its odd rows); an expert box reads only its experts' rows and
columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchtitan.models.common.hf.config import HFConfig

Box = tuple[slice, ...]
"""A block of a tensor: one ``slice(start, stop)`` (step 1) per dimension."""
ReadBox = Callable[[Box], torch.Tensor]
"""Reads a box of one source (Hugging Face) tensor."""


class HFSource(Protocol):
    """Lazily opened Hugging Face tensors, by HF name (``checkpoint/hf_io.py``)."""

    def __contains__(self, name: object) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, box: Box) -> torch.Tensor:
        """One box of the tensor ``name``: only its bytes are read."""
        ...


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


class TensorTransform(Protocol):
    """A per-tensor layout change: ``from_hf(to_hf(w, args), args)`` equals ``w``, and
    ``from_hf_box(read, box, shape, args)`` equals ``from_hf(full, args)[box]`` where ``read``
    reads boxes of the HF tensor ``full`` (of our tensor's ``shape``). A transform without
    ``from_hf_box`` still streams: its whole tensor is read, converted, then cut."""

    def to_hf(self, w: torch.Tensor, args: Any) -> torch.Tensor: ...

    def from_hf(self, w: torch.Tensor, args: Any) -> torch.Tensor: ...

    def from_hf_box(
        self, read: ReadBox, box: Box, shape: tuple[int, ...], args: Any
    ) -> torch.Tensor: ...


def half_split_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs ``(2i, 2i+1)`` (our RoPE) to the two-halves order
    ``(i, i + Dh/2)`` (transformers' ``rotate_half``)."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def interleave_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`half_split_rows`."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


@dataclass(frozen=True)
class RopeRows:
    """The RoPE channel order of a query/key projection (or a per-head norm weight, ``heads``
    None: one head's channels as a vector). The attention scores are unchanged because q and k
    are permuted alike; ``wv``/``wo`` need nothing."""

    heads: str | None
    """The args attribute giving the number of heads in the rows (``n_heads``, ``kv_heads``)."""

    def _n_heads(self, args: Any) -> int:
        return 1 if self.heads is None else int(getattr(args, self.heads))

    @staticmethod
    def _apply(w: torch.Tensor, n_heads: int, fn: Any) -> torch.Tensor:
        if w.dim() == 1:
            return fn(w[:, None], n_heads)[:, 0]
        return fn(w, n_heads)

    def to_hf(self, w: torch.Tensor, args: Any) -> torch.Tensor:
        return self._apply(w, self._n_heads(args), half_split_rows)

    def from_hf(self, w: torch.Tensor, args: Any) -> torch.Tensor:
        return self._apply(w, self._n_heads(args), interleave_rows)

    def from_hf_box(
        self, read: ReadBox, box: Box, shape: tuple[int, ...], args: Any
    ) -> torch.Tensor:
        """Exactly the box's bytes: its whole heads in one read, then permuted; a head the box
        cuts (an FSDP shard boundary inside a head) by two reads, one per half of the head."""
        head_dim = shape[0] // self._n_heads(args)
        rows, cols = box[0], box[1:]
        pieces = []
        for a, b in _head_spans(rows.start, rows.stop, head_dim):
            if a % head_dim == 0 and b % head_dim == 0:
                w = read((slice(a, b), *cols))
                pieces.append(self._apply(w, (b - a) // head_dim, interleave_rows))
            else:
                pieces.append(_part_of_head(read, a, b, head_dim, cols))
        return torch.cat(pieces)


def _head_spans(start: int, stop: int, head_dim: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut at the head boundaries into (part of a head, whole heads, part
    of a head), empty spans left out."""
    first = min(stop, -(-start // head_dim) * head_dim)
    last = max(first, stop // head_dim * head_dim)
    return [(a, b) for a, b in ((start, first), (first, last), (last, stop)) if b > a]


def _part_of_head(read: ReadBox, start: int, stop: int, head_dim: int, cols: Box) -> torch.Tensor:
    """Our rows ``[start, stop)`` inside one head: our row ``2i + j`` is the HF row
    ``j * head_dim / 2 + i`` of the head, so the even and the odd rows are each one
    contiguous run of HF rows."""
    base, half = start // head_dim * head_dim, head_dim // 2
    a, b = start - base, stop - base
    runs = [(j, (a - j + 1) // 2, (b - j + 1) // 2) for j in (0, 1)]
    parts = [
        (j, i0, read((slice(base + j * half + i0, base + j * half + i1), *cols)))
        for j, i0, i1 in runs
        if i1 > i0
    ]
    out = parts[0][2].new_empty((b - a, *parts[0][2].shape[1:]))
    for j, i0, w in parts:
        out[2 * i0 + j - a :: 2] = w
    return out


@dataclass(frozen=True)
class ExpertStack:
    """Routed experts: ours are one stacked tensor per projection, ``<ours>.w1 [E, in, out]``;
    Hugging Face checkpoints hold one ``nn.Linear`` per expert, ``<hf>.<e>.gate_proj.weight
    [out, in]`` (what ``to_hf`` writes). ``fused`` names in-memory layouts that are read too:
    ``[E, k * out, in]`` split into ``k`` of our projections."""

    ours: str = "feed_forward.experts"
    hf: str = "mlp.experts"
    names: Mapping[str, str] = field(
        default_factory=lambda: {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    )
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def to_hf(self, name: str, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-layer HF names and tensors of our stacked per-layer tensor ``name``."""
        proj = self.names[name.removeprefix(self.ours + ".")]
        for e in range(w.shape[0]):
            yield f"{self.hf}.{e}.{proj}.weight", w[e].t().contiguous()

    def per_expert(self, hf_name: str) -> tuple[str, int] | None:
        """``(our name, expert id)`` of a per-expert HF per-layer name, else None."""
        prefix = self.hf + "."
        if not hf_name.startswith(prefix):
            return None
        e, _, rest = hf_name.removeprefix(prefix).partition(".")
        ours = {f"{v}.weight": k for k, v in self.names.items()}.get(rest)
        if not e.isdigit() or ours is None:
            return None
        return f"{self.ours}.{ours}", int(e)

    def hf_name(self, name: str, e: int) -> str:
        """The HF per-layer name of expert ``e`` of our stacked per-layer tensor ``name``."""
        return f"{self.hf}.{e}.{self.names[name.removeprefix(self.ours + '.')]}.weight"

    def fused_source(self, name: str) -> tuple[str, int, int] | None:
        """``(fused HF per-layer name, part index, number of parts)`` holding our ``name``."""
        ours = name.removeprefix(self.ours + ".")
        for fused, parts in self.fused.items():
            if ours in parts:
                return f"{self.hf}.{fused}", parts.index(ours), len(parts)
        return None

    def from_hf_box(self, name: str, box: Box, source: HFSource) -> torch.Tensor:
        """A box ``(experts, in, out)`` of our stacked ``name`` read from the per-expert HF
        tensors (``[out, in]`` each: only the box's experts, rows and columns), or from the
        fused layout ``[E, parts * out, in]`` when the source has no per-expert tensors."""
        experts, cols, rows = box
        if experts.stop == experts.start:
            return torch.empty(box_shape(box))
        if self.hf_name(name, experts.start) in source:
            ids = range(experts.start, experts.stop)
            return torch.stack([source.read(self.hf_name(name, e), (rows, cols)).t() for e in ids])
        found = self.fused_source(name)
        if found is None or found[0] not in source:
            raise KeyError(f"no Hugging Face tensor holds {name} of expert {experts.start}")
        fused, part, n_parts = found
        start = part * (source.shape(fused)[1] // n_parts) + rows.start
        fused_rows = slice(start, start + rows.stop - rows.start)
        return source.read(fused, (experts, fused_rows, cols)).transpose(1, 2)

    def unfuse(self, hf_name: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Our stacked tensors from a fused HF per-layer tensor, else None."""
        ours = self.fused.get(hf_name.removeprefix(self.hf + "."))
        if not hf_name.startswith(self.hf + ".") or ours is None:
            return None
        parts = w.chunk(len(ours), dim=1)
        return {f"{self.ours}.{n}": p.transpose(1, 2).contiguous() for n, p in zip(ours, parts)}


@dataclass(frozen=True)
class OursOnly:
    """A per-layer tensor with no Hugging Face counterpart: exported only while zero (else
    ``ValueError(reason)``), imported as zeros, one per row of the per-layer tensor ``like``."""

    like: str
    reason: str


@dataclass(frozen=True)
class HFMapping:
    """Everything that differs between our state dict and a family's Hugging Face checkpoint."""

    top: Mapping[str, str]
    """Our top-level name -> HF name (embedding, final norm, head)."""
    layer: Mapping[str, str]
    """Our per-layer name (inside ``layers.<i>.``) -> HF's (inside ``model.layers.<i>.``)."""
    config: HFConfig
    """Our args <-> ``config.json``."""
    transforms: Mapping[str, TensorTransform] = field(default_factory=dict)
    """Our per-layer name -> its layout change (names absent: copied as they are)."""
    experts: ExpertStack | None = None
    ours_only: Mapping[str, OursOnly] = field(default_factory=dict)
    tied: tuple[str, str] = ("output.weight", "tok_embeddings.weight")
    """(head, embedding): with ``args.tie_word_embeddings`` HF stores the shared matrix once."""
    ignored_hf: tuple[str, ...] = ("rotary_emb.inv_freq",)
    """Suffixes of HF keys that are skipped (buffers some exports include)."""
    layers: tuple[str, str] = ("layers", "model.layers")
    unmapped_hint: str = ""
    """Appended to the error for a tensor of ours without an HF name."""
