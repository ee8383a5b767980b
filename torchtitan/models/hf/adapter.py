"""The ``hf`` family's Hugging Face adapter: our names are transformers' names, so every
tensor passes through unchanged, and ``config.json`` is the source file's with this run's
vocabulary (docs/hf_models.md). It offers what the streaming import/export of
``checkpoint/hf_io.py`` and ``convert.py`` call on any family's adapter."""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.models.common.hf.mapping import Box, HFSource
from torchtitan.models.hf.args import HFArgs

_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
_FUSED = re.compile(r"^(.+\.experts)\.(gate_up_proj|down_proj)$")
"""transformers (>= 5) holds a mixture's experts fused in memory (``experts.gate_up_proj``
``[E, 2I, D]``, ``experts.down_proj`` ``[E, D, I]``) and stores them one ``Linear`` per expert
(``experts.<e>.gate_proj.weight`` ...): both directions convert."""


class PassThroughAdapter:
    def __init__(self, args: HFArgs) -> None:
        self.args = args

    def _tied(self) -> bool:
        return self.args.tie_word_embeddings

    def to_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for key, w in sd.items() for k, v in self.to_hf_one(key, w)}

    def to_hf_one(
        self, key: str, w: torch.Tensor, check: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        if self.exports_nothing(key):
            return []
        fused = _FUSED.match(key)
        if fused is None:
            return [(key, w.contiguous())]
        base, kind = fused.groups()
        out: list[tuple[str, torch.Tensor]] = []
        for e in range(w.shape[0]):
            if kind == "down_proj":
                out.append((f"{base}.{e}.down_proj.weight", w[e].contiguous()))
                continue
            gate, up = w[e].chunk(2, dim=0)
            out.append((f"{base}.{e}.gate_proj.weight", gate.contiguous()))
            out.append((f"{base}.{e}.up_proj.weight", up.contiguous()))
        return out

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v for k, v in hf.items() if not _PER_EXPERT.match(k)}
        for key in {_PER_EXPERT.sub(_fused_name, k) for k in hf if _PER_EXPERT.match(k)}:
            fused = _FUSED.match(key)
            assert fused is not None
            n = 1 + max(int(m.group(2)) for k in hf if (m := _PER_EXPERT.match(k)))
            out[key] = torch.stack([_expert(hf.__getitem__, fused.groups(), e) for e in range(n)])
        if self._tied() and _HEAD not in out and _EMBEDDING in out:
            out[_HEAD] = out[_EMBEDDING]
        return out

    def tied_to(self, key: str) -> str | None:
        return _EMBEDDING if self.exports_nothing(key) else None

    def exports_nothing(self, key: str) -> bool:
        """The tied head: transformers stores the shared matrix once, as the embedding."""
        return self._tied() and key == _HEAD

    def from_hf_box(
        self, key: str, shape: tuple[int, ...], box: Box, source: HFSource
    ) -> torch.Tensor:
        name = key
        if self.exports_nothing(key) and key not in source:
            name = _EMBEDDING
        fused = _FUSED.match(key)
        if fused is None or key in source:
            return source.read(name, box)

        def whole(hf_name: str) -> torch.Tensor:
            return source.read(hf_name, tuple(slice(0, n) for n in source.shape(hf_name)))

        experts = range(shape[0])[box[0]]
        stacked = torch.stack([_expert(whole, fused.groups(), e) for e in experts])
        return stacked[(slice(None), *box[1:])]

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The source ``config.json`` with this model's vocabulary and dtype."""
        config = dict(self.args.hf_config)
        config["vocab_size"] = self.args.vocab_size
        config["dtype"] = str(dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
        config["use_cache"] = True
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(config.get(key), int) and config[key] >= self.args.vocab_size:
                config[key] = None
        return config


_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused_name(m: re.Match[str]) -> str:
    return f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}"


def _expert(read: Any, fused: tuple[str, ...], e: int) -> torch.Tensor:
    """Expert ``e`` of a fused tensor (``fused``: its base path and kind), from per-expert ones."""
    base, kind = fused
    if kind == "down_proj":
        t: torch.Tensor = read(f"{base}.{e}.down_proj.weight")
        return t
    gate, up = read(f"{base}.{e}.gate_proj.weight"), read(f"{base}.{e}.up_proj.weight")
    return torch.cat([gate, up], dim=0)
