"""The one Hugging Face state-dict adapter: applies a family's :class:`HFMapping` both ways
(docs/extending.md, section 5).

``to_hf``/``from_hf`` work on full (unsharded) plain tensors. Top-level tensors are passed
through (the tied head and embedding stay one tensor); per-layer ones are renamed, transformed
and made contiguous; routed experts are unstacked into one HF tensor each (and stacked back).

The streaming paths (docs/hf_io.md) use two more: ``from_hf_box`` builds one box of one of our
tensors from lazily opened HF files, reading only the source bytes that box needs;
``to_hf_one`` converts one full tensor at a time (on ``meta`` it only plans names and shapes).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.models.common.hf.mapping import Box, HFMapping, HFSource, box_shape


class _Prefixed:
    """An :class:`HFSource` seen from inside one layer (``model.layers.<i>.``)."""

    def __init__(self, source: HFSource, prefix: str) -> None:
        self.source, self.prefix = source, prefix

    def __contains__(self, name: object) -> bool:
        return f"{self.prefix}{name}" in self.source

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(self.prefix + name)

    def read(self, name: str, box: Box) -> torch.Tensor:
        return self.source.read(self.prefix + name, box)


class StateDictAdapter:
    """Converts full state dicts between our names and layouts and Hugging Face's, for one
    family's ``mapping`` and one flavor's ``args``."""

    def __init__(self, mapping: HFMapping, args: Any) -> None:
        self.mapping, self.args = mapping, args
        ours, hf = mapping.layers
        self._ours_layer = re.compile(rf"^{re.escape(ours)}\.(\d+)\.(.+)$")
        self._hf_layer = re.compile(rf"^{re.escape(hf)}\.(\d+)\.(.+)$")
        self._hf_top = {v: k for k, v in mapping.top.items()}
        self._hf_names = {v: k for k, v in mapping.layer.items()}

    @property
    def _tied(self) -> bool:
        return bool(self.args.tie_word_embeddings)

    def to_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, w in sd.items():
            out.update(self.to_hf_one(key, w))
        return out

    def to_hf_one(
        self, key: str, w: torch.Tensor, check: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of our full tensor ``key`` (none for the tied head and the tensors HF
        has no name for; ``check=False`` skips the check that those are zero, for ``meta``)."""
        m = self.mapping
        if key in m.top:
            # HF stores a tied matrix once
            return [] if self._tied and key == m.tied[0] else [(m.top[key], w)]
        found = self._ours_layer.match(key)
        if found is None:
            raise KeyError(f"no Hugging Face name for {key!r}")
        prefix = f"{m.layers[1]}.{found.group(1)}."
        return [(prefix + k, v) for k, v in self._layer_to_hf(key, found.group(2), w, check)]

    def tied_to(self, key: str) -> str | None:
        """The embedding's name for the tied head (the same values), else None."""
        return self.mapping.tied[1] if self.exports_nothing(key) else None

    def exports_nothing(self, key: str) -> bool:
        """True for the tied head (HF stores the shared matrix once, under the embedding)."""
        return self._tied and key == self.mapping.tied[0]

    def _layer_to_hf(
        self, key: str, name: str, w: torch.Tensor, check: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        m = self.mapping
        if name in m.ours_only:
            if check and bool(w.any()):
                raise ValueError(f"{key} is non-zero: {m.ours_only[name].reason}")
            return []
        if m.experts is not None and name.startswith(m.experts.ours + "."):
            return list(m.experts.to_hf(name, w))
        if name not in m.layer:
            raise KeyError(f"no Hugging Face name for {key!r}{m.unmapped_hint}")
        transform = m.transforms.get(name)
        w = transform.to_hf(w, self.args) if transform is not None else w
        return [(m.layer[name], w.contiguous())]

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m = self.mapping
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for key, w in hf.items():
            if key in self._hf_top:
                out[self._hf_top[key]] = w
                continue
            found = self._hf_layer.match(key)
            if key.endswith(m.ignored_hf):
                continue  # recomputed from the config
            if found is None:
                raise KeyError(f"unexpected Hugging Face key {key!r}")
            layer, name = found.groups()
            prefix = f"{m.layers[0]}.{layer}."
            if name in self._hf_names:
                ours = self._hf_names[name]
                transform = m.transforms.get(ours)
                w = transform.from_hf(w, self.args) if transform is not None else w
                out[prefix + ours] = w.contiguous()
            elif m.experts is not None and (one := m.experts.per_expert(name)) is not None:
                experts.setdefault(prefix + one[0], {})[one[1]] = w.t()
            elif m.experts is not None and (parts := m.experts.unfuse(name, w)) is not None:
                out.update({prefix + k: v for k, v in parts.items()})
            else:
                raise KeyError(f"unexpected Hugging Face key {key!r}")
        for ours, by_id in experts.items():
            out[ours] = torch.stack([by_id[i] for i in range(len(by_id))]).contiguous()
        self._add_ours_only(out)
        head, embedding = m.tied
        if self._tied and head not in out and embedding in out:  # (a part may lack both)
            out[head] = out[embedding]
        return out

    def from_hf_box(
        self, key: str, shape: tuple[int, ...], box: Box, source: HFSource
    ) -> torch.Tensor:
        """``box`` of our tensor ``key`` (of full ``shape``), equal to ``from_hf(all)[key][box]``
        but reading from ``source`` only the bytes the box needs (docs/hf_io.md)."""
        m = self.mapping
        if any(s.stop <= s.start for s in box):
            return torch.empty(box_shape(box))
        if key in m.top:
            hf = m.top[key]
            if self._tied and key == m.tied[0] and hf not in source:
                hf = m.top[m.tied[1]]  # HF stores a tied matrix once
            return source.read(hf, box)
        found = self._ours_layer.match(key)
        if found is None:
            raise KeyError(f"no Hugging Face name for {key!r}")
        prefix, name = f"{m.layers[1]}.{found.group(1)}.", found.group(2)
        if name in m.ours_only:
            return torch.zeros(box_shape(box))
        if m.experts is not None and name.startswith(m.experts.ours + "."):
            return m.experts.from_hf_box(name, box, _Prefixed(source, prefix))
        if name not in m.layer:
            raise KeyError(f"no Hugging Face name for {key!r}{m.unmapped_hint}")
        hf_name = prefix + m.layer[name]
        transform = m.transforms.get(name)
        if transform is None:
            return source.read(hf_name, box)
        if getattr(transform, "from_hf_box", None) is None:
            # A transform that says nothing about slices: its whole tensor, then the box.
            whole = tuple(slice(0, n) for n in source.shape(hf_name))
            return transform.from_hf(source.read(hf_name, whole), self.args)[box]
        return transform.from_hf_box(lambda b: source.read(hf_name, b), box, shape, self.args)

    def _add_ours_only(self, out: dict[str, torch.Tensor]) -> None:
        """Zeros for the tensors HF has no name for, one per row of their ``like`` tensor."""
        for name, only in self.mapping.ours_only.items():
            for key in [k for k in out if k.endswith("." + only.like)]:
                found = self._ours_layer.match(key)
                if found is not None and found.group(2) == only.like:
                    like = out[key]
                    out[key.removesuffix(only.like) + name] = like.new_zeros(like.shape[0])

    def args_for_weights(self, names: Any) -> Any:
        """The args for a folder holding the HF tensor ``names``: ``args`` (a family whose
        ``config.json`` may declare modules its weights lack adjusts them: DeepSeek-V3's MTP)."""
        return self.args

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """``config.json`` for the family's transformers class with these args."""
        return self.mapping.config.to_hf(self.args, dtype)
